"""The encoder-decoder kind (BART, Whisper): generation, with an encoder input per request.

Generation is the decoder's and works as for any generative model (the same sampler, stop
rules, outputs); what this kind changes is the prompt (an encoder input and a decoder prompt,
`encoder_decoder_prompts.py`), its KV-cache groups (self attention plus cross attention, which
holds each request's encoder K/V, `EncoderDecoderScheduler`), and the runner (encoders run in
the step that admits a request, `encoder_decoder_runner.py`). The pool must hold one full
decoder sequence and one full encoder.
"""

from __future__ import annotations

from typing import Any

from tokenwise.engine.kinds.encoder_decoder_prompts import EncoderDecoderPrompts
from tokenwise.engine.kinds.encoder_decoder_runner import EncoderDecoderRunnerPart
from tokenwise.engine.kinds.encoder_decoder_scheduler import EncoderDecoderScheduler
from tokenwise.engine.kinds.generate import GenerateKind
from tokenwise.engine.kinds.requests import EncoderDecoderRequest
from tokenwise.engine.prompts import PromptInput, validate_request
from tokenwise.engine.request import Request
from tokenwise.sampling.params import SamplingParams


class EncoderDecoderKind(GenerateKind):
    name = "encoder-decoder"
    runner_part = EncoderDecoderRunnerPart
    scheduler_cls = EncoderDecoderScheduler
    # A decoder's K/V depends on its encoder's input too, not on its tokens alone.
    unique_prefix_cache = True

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self.prompts = EncoderDecoderPrompts(engine.model_config, engine.tokenizer)

    def check_kv_capacity(self, num_blocks: int) -> None:
        """One decoder sequence at max_model_len plus one whole encoder must fit."""
        block_size = self.engine.config.cache.block_size
        max_model_len = self.engine.model_config.max_model_len
        max_encoder_len = self.prompts.max_encoder_len
        encoder_blocks = -(-max_encoder_len // block_size)
        decoder_blocks = -(-max_model_len // block_size)
        if num_blocks < encoder_blocks + decoder_blocks:
            raise ValueError(
                f"the KV cache has {num_blocks} blocks of {block_size} tokens, fewer than one "
                f"request may need: {decoder_blocks} for its decoder (max_model_len="
                f"{max_model_len}) plus {encoder_blocks} for its encoder's "
                f"cross-attention ({max_encoder_len} tokens); give it at least "
                f"{encoder_blocks + decoder_blocks} blocks (num_gpu_blocks, or more "
                "kv_cache_memory / gpu_memory_utilization) or lower max_model_len"
            )

    def request_cls(self) -> type[Request]:
        return EncoderDecoderRequest

    def process_prompt(
        self, prompt: PromptInput, params: SamplingParams
    ) -> tuple[str | None, list[int], dict[str, Any]]:
        engine = self.engine
        # The checks of sampling parameters that need no prompt, as for a decoder-only model.
        validate_request(engine.model_config, engine.tokenizer, [0], params)
        text, ids, encoder_inputs = self.prompts.process(prompt)
        return text, ids, {"encoder_inputs": encoder_inputs}
