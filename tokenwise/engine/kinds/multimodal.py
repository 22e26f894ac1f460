"""The vision-language kind (LLaVA, Qwen2.5-VL): generation from prompts that may hold images.

Generation, outputs and the KV cache are the decoder's; this kind changes three things:

- the prompt: `{"prompt": text, "multi_modal_data": {"image": ...}}` goes through the
  checkpoint's processor (`multimodal_prompts.py`, `image_inputs.py`), which expands each
  `<image>` placeholder; the request (`MultiModalRequest`) keeps each image's placeholder run,
  pixels and content hash. Behind an engine-core process the client does this and sends a
  `ProcessedImagePrompt`;
- the scheduler: every block's prefix-cache hash includes the content hashes of the images
  whose placeholders it covers (`BlockManager`'s extra keys), so the same text with another
  image never hits, and the same image does; and a step encodes at most
  `max_num_encoder_input_tokens` image tokens (`encoder_budget.py`);
- the runner (`multimodal_runner.py`): image embeddings replace the placeholders' embeddings,
  chunk by chunk, from an encoder cache.

A model whose image tokens attend to each other both ways (Gemma 3,
`bidirectional_image_attention`) marks its requests `whole_images`: the scheduler never cuts
such an image across chunks, and the runner puts the images' spans on the attention metadata.

A model with M-RoPE (Qwen2.5-VL, `uses_mrope`) has images of any size (`grid_image_inputs.py`)
and 3-D positions, computed here once per prompt (`mrope_positions.py`) and stored on the
request for the runner.

Text-only prompts run as on the text model.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tokenwise.config import SchedulerConfig
from tokenwise.engine.block_manager import ImageSpans
from tokenwise.engine.kinds.encoder_budget import EncoderBudget
from tokenwise.engine.kinds.generate import GenerateKind
from tokenwise.engine.kinds.multimodal_prompts import (
    MultiModalPrompts,
    ProcessedImagePrompt,
    prompt_settings,
)
from tokenwise.engine.kinds.multimodal_runner import MultiModalRunnerPart
from tokenwise.engine.kinds.requests import MultiModalRequest
from tokenwise.engine.prompts import PromptInput
from tokenwise.engine.request import Request, RequestStatus
from tokenwise.engine.scheduler import Scheduler, SchedulerOutput
from tokenwise.models.llava import image_token_id
from tokenwise.sampling.params import SamplingParams


class MultiModalScheduler(Scheduler):
    """The decoder's scheduler, with image hashes in the prefix cache's keys, the vision
    tower's per-step budget (`encoder_budget.py`), and images that must be computed whole.

    A request with `whole_images` (Gemma 3: an image's tokens attend to each other both
    ways) never has a chunk end inside an image: the chunk stops before the image, or, if it
    starts inside or at it, runs to its end or waits for a step with budget for it (vLLM's
    `disable_chunked_mm_input`). A prefix-cache hit may end inside such an image: those
    cached tokens were computed with the whole image, so the rest of it is still exact. The
    encoder budget then only ever stops a chunk before an image, so images stay whole.
    """

    def __init__(self, config: SchedulerConfig, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        assert config.max_num_encoder_input_tokens is not None
        self.encoder_budget = EncoderBudget(config.max_num_encoder_input_tokens)

    def image_spans(self, request: Request) -> ImageSpans:
        return getattr(request, "image_hash_spans", ())

    def add_request(self, request: Request) -> None:
        budget = self.config.max_num_batched_tokens
        if getattr(request, "whole_images", False):
            longest = max((im.length for im in getattr(request, "images", ())), default=0)
            if longest > budget:
                raise ValueError(
                    f"an image of {longest} tokens must be computed in one step, more than "
                    f"max_num_batched_tokens={budget}; raise max_num_batched_tokens"
                )
        super().add_request(request)

    def schedule(self) -> SchedulerOutput:
        self.encoder_budget.begin_step()
        out = super().schedule()
        self.encoder_budget.commit(out.scheduled)
        return out

    def limit_chunk(self, request: Request, num_computed: int, num_new: int) -> int:
        if getattr(request, "whole_images", False):
            end = num_computed + num_new
            for image in getattr(request, "images", ()):
                if image.offset < end < image.end:  # the chunk would cut this image
                    num_new = max(image.offset - num_computed, 0)
                    break
        may_cut = self.config.enable_chunked_prefill
        return self.encoder_budget.limit(request, num_computed, num_new, may_cut)

    def drop_chunk(self, request: Request) -> None:
        self.encoder_budget.forget(request.request_id)

    def _preempt(self, req: Request) -> None:
        self.encoder_budget.release_request(req.request_id)
        super()._preempt(req)

    def finish_requests(
        self, requests: Iterable[Request], status: RequestStatus, discard_cached: bool = False
    ) -> None:
        requests = list(requests)
        for req in requests:
            self.encoder_budget.release_request(req.request_id)
        super().finish_requests(requests, status, discard_cached)


class MultiModalKind(GenerateKind):
    name = "multimodal"
    runner_part = MultiModalRunnerPart
    scheduler_cls = MultiModalScheduler

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        mc = engine.model_config
        token_id = image_token_id(mc.hf_multimodal_config)
        self.processor = MultiModalPrompts(
            mc, engine.tokenizer, prompt_settings(engine.runner.kind_part.eager_model, token_id)
        )
        self.image_token_id = token_id
        self.uses_mrope = self.processor.uses_mrope
        self.merge_size = self.processor.merge_size
        self.whole_images = self.processor.whole_images
        self.prompts = self.processor.prompts  # the checkpoint's processor, for callers

    def prompt_settings(self) -> dict[str, int]:
        return self.processor.settings

    def request_cls(self) -> type[Request]:
        return MultiModalRequest

    def process_prompt(
        self, prompt: PromptInput, params: SamplingParams
    ) -> tuple[str | None, list[int], dict[str, Any]]:
        if isinstance(prompt, ProcessedImagePrompt):  # from an engine-core client
            return self.processor.accept_processed(prompt, params)
        return self.processor.process(prompt, params)
