"""The engine of an encoder-decoder model (BART, Whisper): `LLMEngine` with three parts swapped.

Generation is the decoder's and works as for any generative model (the same scheduler, sampler,
stop conditions, outputs); what differs is the prompt (an encoder input and a decoder prompt,
`encoder_decoder_prompts.py`), the block manager (a cross table per request from the same pool,
`encoder_decoder.py`) and the runner (encoders run in the step that admits a request,
`encoder_decoder_runner.py`). The pool must hold one full decoder sequence and one full encoder.
"""

from __future__ import annotations

from tokenwise.config import EngineConfig
from tokenwise.engine.block_manager import BlockManager
from tokenwise.engine.kinds.encoder_decoder_prompts import EncoderDecoderPrompts
from tokenwise.engine.kinds.encoder_decoder_runner import EncoderDecoderModelRunner
from tokenwise.engine.kinds.encoder_inputs import EncoderInputs
from tokenwise.engine.llm_engine import LLMEngine
from tokenwise.engine.prompts import PromptInput, validate_request
from tokenwise.sampling.params import SamplingParams


class EncoderDecoderLLMEngine(LLMEngine):
    runner_cls = EncoderDecoderModelRunner

    def __init__(self, config: EngineConfig, device: str = "cpu") -> None:
        super().__init__(config, device)
        self.prompts = EncoderDecoderPrompts(config.model, self.tokenizer)

    def _check_kv_capacity(self, num_blocks: int) -> None:
        """One decoder sequence at max_model_len plus one whole encoder must fit."""
        block_size = self.config.cache.block_size
        max_encoder_len = self.runner.max_encoder_len()  # type: ignore[attr-defined]
        encoder_blocks = -(-max_encoder_len // block_size)
        decoder_blocks = -(-self.model_config.max_model_len // block_size)
        if num_blocks < encoder_blocks + decoder_blocks:
            raise ValueError(
                f"the KV cache has {num_blocks} blocks of {block_size} tokens, fewer than one "
                f"request may need: {decoder_blocks} for its decoder (max_model_len="
                f"{self.model_config.max_model_len}) plus {encoder_blocks} for its encoder's "
                f"cross-attention ({max_encoder_len} tokens); give it at least "
                f"{encoder_blocks + decoder_blocks} blocks (num_gpu_blocks, or more "
                "kv_cache_memory / gpu_memory_utilization) or lower max_model_len"
            )

    def _make_block_manager(self, num_blocks: int) -> BlockManager:
        # Two KV-cache groups: the decoder's own blocks and the encoder's cross blocks.
        return BlockManager(num_blocks, self.config.cache.block_size, num_kv_cache_groups=2)

    def _process_prompt(
        self, prompt: PromptInput, params: SamplingParams
    ) -> tuple[str | None, list[int], EncoderInputs | None]:
        # The checks of sampling parameters that need no prompt, as for a decoder-only model.
        validate_request(self.model_config, self.tokenizer, [0], params)
        return self.prompts.process(prompt)
