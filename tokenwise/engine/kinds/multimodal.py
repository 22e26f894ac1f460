"""The vision-language kind (LLaVA, Qwen2.5-VL): generation from prompts that may hold images.

Generation, outputs and the KV cache are the decoder's; this kind changes three things:

- the prompt: `{"prompt": text, "multi_modal_data": {"image": ...}}` goes through the
  checkpoint's processor (`image_inputs.py`), which expands each `<image>` placeholder; the
  request (`MultiModalRequest`) keeps each image's placeholder run, pixels and content hash;
- the scheduler: every block's prefix-cache hash includes the content hashes of the images
  whose placeholders it covers (`BlockManager`'s extra keys), so the same text with another
  image never hits, and the same image does;
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

from typing import Any

from tokenwise.engine.block_manager import ImageSpans
from tokenwise.engine.kinds.generate import GenerateKind
from tokenwise.engine.kinds.grid_image_inputs import GridImagePrompts
from tokenwise.engine.kinds.image_inputs import ImagePrompts, as_image_list
from tokenwise.engine.kinds.mrope_positions import prompt_mrope_positions
from tokenwise.engine.kinds.multimodal_runner import MultiModalModelRunner
from tokenwise.engine.kinds.requests import MultiModalRequest
from tokenwise.engine.prompts import PromptInput, check_text, validate_request
from tokenwise.engine.request import Request
from tokenwise.engine.scheduler import Scheduler
from tokenwise.models.llava import image_token_id
from tokenwise.sampling.params import SamplingParams


class MultiModalScheduler(Scheduler):
    """Image hashes key the prefix cache; images that must be computed whole stay whole.

    A request with `whole_images` (Gemma 3: an image's tokens attend to each other both
    ways) never has a chunk end inside an image: the chunk stops before the image, or, if it
    starts inside or at it, runs to its end or waits for a step with budget for it (vLLM's
    `disable_chunked_mm_input`). A prefix-cache hit may end inside such an image: those
    cached tokens were computed with the whole image, so the rest of it is still exact.
    """

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

    def limit_chunk(self, request: Request, num_computed: int, num_new: int) -> int:
        if not getattr(request, "whole_images", False):
            return num_new
        end = num_computed + num_new
        for image in getattr(request, "images", ()):
            if image.offset < end < image.end:  # the chunk would cut this image
                return max(image.offset - num_computed, 0)
        return num_new


def multi_modal_data(prompt: PromptInput) -> dict[str, Any] | None:
    """A prompt's `multi_modal_data`, checked to be a dict (None when it has none)."""
    if not isinstance(prompt, dict) or prompt.get("multi_modal_data") is None:
        return None
    data = prompt["multi_modal_data"]
    if not isinstance(data, dict):
        raise ValueError(
            f"multi_modal_data must be a dict such as {{'image': image}}, got {type(data).__name__}"
        )
    return data


class MultiModalKind(GenerateKind):
    name = "multimodal"
    runner_cls = MultiModalModelRunner
    scheduler_cls = MultiModalScheduler

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        mc = engine.model_config
        model = engine.runner.eager_model
        self.image_token_id = image_token_id(mc.hf_multimodal_config)
        self.uses_mrope = bool(getattr(model, "uses_mrope", False))
        self.whole_images = bool(getattr(model, "bidirectional_image_attention", False))
        self.prompts: ImagePrompts | GridImagePrompts
        if self.uses_mrope:
            self.merge_size = int(model.spatial_merge_size)
            self.prompts = GridImagePrompts(
                mc.model, engine.tokenizer, self.image_token_id, self.merge_size
            )
        else:
            self.prompts = ImagePrompts(mc.model, self.image_token_id, int(model.num_image_tokens))

    def request_cls(self) -> type[Request]:
        return MultiModalRequest

    def process_prompt(
        self, prompt: PromptInput, params: SamplingParams
    ) -> tuple[str | None, list[int], dict[str, Any]]:
        engine = self.engine
        data = multi_modal_data(prompt)
        images = []
        if data is not None:
            unknown = sorted(set(data) - {"image"})
            if unknown:
                raise ValueError(
                    f"this model reads images only; multi_modal_data has {', '.join(unknown)}"
                )
            if data.get("image") is not None:
                images = as_image_list(data["image"])
        limit = (engine.model_config.limit_mm_per_prompt or {}).get("image")
        if limit is not None and len(images) > limit:
            raise ValueError(
                f"the prompt has {len(images)} images, more than the {limit} per prompt this "
                "server allows (limit_mm_per_prompt / --limit-mm-per-prompt)"
            )
        if not images:
            text, ids = validate_request(engine.model_config, engine.tokenizer, prompt, params)
            if self.image_token_id in ids:
                raise ValueError(
                    "the prompt holds the image placeholder token but no image was given "
                    "(pass it in multi_modal_data={'image': ...})"
                )
            return text, ids, {"images": []}
        assert isinstance(prompt, dict)
        text = prompt.get("prompt")
        if not isinstance(text, str) or "prompt_token_ids" in prompt:
            raise ValueError(
                "a prompt with images must be given as text ({'prompt': '... <image> ...'}): "
                "the model's processor expands each image placeholder"
            )
        if params.truncate_prompt_tokens is not None:
            raise ValueError("truncate_prompt_tokens cannot be used with images (it could cut one)")
        check_text(text, "prompt")
        ids, image_inputs = self.prompts.process(text, images)
        validate_request(engine.model_config, engine.tokenizer, {"prompt_token_ids": ids}, params)
        extra: dict[str, Any] = {"images": image_inputs, "whole_images": self.whole_images}
        if self.uses_mrope:
            positions, delta = prompt_mrope_positions(len(ids), image_inputs, self.merge_size)
            extra.update(mrope_positions=positions, mrope_position_delta=delta)
        return text, ids, extra
