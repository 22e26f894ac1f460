"""Prompts with images turned into token ids and image inputs: in the engine, or in the front
end of an engine-core process.

`MultiModalPrompts` checks a prompt's `multi_modal_data`, runs the checkpoint's processor
(`image_inputs.py`, `grid_image_inputs.py`) and computes M-RoPE positions; it needs the
configuration, the tokenizer and a few numbers the model decides (`prompt_settings`): the
placeholder token, whether positions are 3-D, the merge size, LLaVA's tokens per image, and
whether images must be computed whole.
The in-process engine takes them from its model; an `EngineCoreClient` gets them from its core
when the core is ready, and processes every prompt before sending it, for three reasons:

- a bad prompt fails in the caller, as a ValueError (a 400 in the server), exactly as with an
  in-process engine, not later as a rejection from the core;
- resizing and normalising images is CPU work that would otherwise stall the core's loop,
  and with it every running request's next token: the core only schedules and runs steps;
- what travels is what the runner reads (`ProcessedImagePrompt`: token ids, each image's
  placeholder run, pixel tensor and hash, positions), plain data that pickles as is, so the
  core never loads the processor nor sees PIL images.

This is vLLM's split too (the input processor runs in the API server's process).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenwise.engine.kinds.gemma4_image_inputs import Gemma4ImagePrompts
from tokenwise.engine.kinds.grid_image_inputs import GridImagePrompts
from tokenwise.engine.kinds.image_inputs import ImagePrompts, as_image_list
from tokenwise.engine.kinds.mrope_positions import prompt_mrope_positions
from tokenwise.engine.kinds.video_prompts import as_video_list
from tokenwise.engine.prompts import PromptInput, check_text, validate_request
from tokenwise.sampling.params import SamplingParams


@dataclass
class ProcessedImagePrompt:
    """A prompt a front end already processed: the request's text, token ids (placeholders
    expanded) and extra fields (`images`, and `mrope_positions` / `mrope_position_delta`)."""

    text: str | None
    token_ids: list[int]
    extra: dict[str, Any] = field(default_factory=dict)


def prompt_settings(model: Any, image_token_id: int) -> dict[str, int]:
    """What prompt processing needs to know of the built model (sent to a front end)."""
    uses_mrope = bool(getattr(model, "uses_mrope", False))
    variable = bool(getattr(model, "variable_image_tokens", False))
    return {
        "image_token_id": image_token_id,
        "uses_mrope": int(uses_mrope),
        "merge_size": int(model.spatial_merge_size) if uses_mrope else 0,
        "num_image_tokens": 0 if uses_mrope or variable else int(model.num_image_tokens),
        # Gemma 4: each image has its own number of soft tokens, from its aspect ratio.
        "variable_image_tokens": int(variable),
        # Gemma 3: an image's tokens attend to each other both ways (chunks never cut one).
        "whole_images": int(bool(getattr(model, "bidirectional_image_attention", False))),
        # Qwen3.5: videos, and their placeholder and vision start / end tokens (-1: none).
        **{
            f"video_{name}_token_id": int(getattr(model, f"video_{name}_token_id", -1))
            for name in ("pad", "start", "end")
        },
    }


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


class MultiModalPrompts:
    def __init__(self, model_config: Any, tokenizer: Any, settings: dict[str, int]) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.settings = dict(settings)
        self.image_token_id = settings["image_token_id"]
        self.uses_mrope = bool(settings["uses_mrope"])
        self.merge_size = settings["merge_size"]
        self.whole_images = bool(settings.get("whole_images", 0))
        self.prompts: ImagePrompts | GridImagePrompts
        self.video_tokens = {
            key: settings.get(f"video_{name}_token_id", -1)
            for key, name in (("video", "pad"), ("start", "start"), ("end", "end"))
        }
        self.reads_video = self.uses_mrope and self.video_tokens["video"] >= 0
        if self.uses_mrope:
            self.prompts = GridImagePrompts(
                model_config.model,
                tokenizer,
                self.image_token_id,
                self.merge_size,
                self.video_tokens if self.reads_video else None,
            )
        elif settings.get("variable_image_tokens"):
            self.prompts = Gemma4ImagePrompts(
                model_config.model, tokenizer, model_config.hf_multimodal_config
            )
        else:
            self.prompts = ImagePrompts(
                model_config.model, self.image_token_id, settings["num_image_tokens"]
            )

    @property
    def image_token(self) -> str:
        return self.prompts.image_token

    def process(
        self, prompt: PromptInput, params: SamplingParams
    ) -> tuple[str | None, list[int], dict[str, Any]]:
        """(text, token ids, the request's extra fields) of a prompt, checked."""
        mc, tokenizer = self.model_config, self.tokenizer
        data = multi_modal_data(prompt)
        images, videos = self.check_data(data)
        if not images and not videos:
            text, ids = validate_request(mc, tokenizer, prompt, params)
            if self.image_token_id in ids:
                raise ValueError(
                    "the prompt holds the image placeholder token but no image was given "
                    "(pass it in multi_modal_data={'image': ...})"
                )
            if self.reads_video and self.video_tokens["video"] in ids:
                raise ValueError(
                    "the prompt holds the video placeholder token but no video was given "
                    "(pass it in multi_modal_data={'video': frames})"
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
        if videos:
            assert isinstance(self.prompts, GridImagePrompts)
            ids, image_inputs = self.prompts.process(text, images, videos)
        else:
            ids, image_inputs = self.prompts.process(text, images)
        validate_request(mc, tokenizer, {"prompt_token_ids": ids}, params)
        extra: dict[str, Any] = {"images": image_inputs}
        if self.whole_images:  # the request's field (Gemma 3); others keep its default
            extra["whole_images"] = True
        if self.uses_mrope:
            positions, delta = prompt_mrope_positions(len(ids), image_inputs, self.merge_size)
            extra.update(mrope_positions=positions, mrope_position_delta=delta)
        return text, ids, extra

    def check_data(self, data: dict[str, Any] | None) -> tuple[list[Any], list[Any]]:
        """The prompt's images and videos, checked against the model and the limits."""
        if data is None:
            return [], []
        modalities = {"image", "video"} if self.reads_video else {"image"}
        unknown = sorted(set(data) - modalities)
        if unknown:
            reads = " and ".join(f"{m}s" for m in sorted(modalities))
            raise ValueError(
                f"this model reads {reads} only; multi_modal_data has {', '.join(unknown)}"
            )
        images = as_image_list(data["image"]) if data.get("image") is not None else []
        videos = as_video_list(data["video"]) if data.get("video") is not None else []
        limits = self.model_config.limit_mm_per_prompt or {}
        for name, items in (("image", images), ("video", videos)):
            limit = limits.get(name)
            if limit is not None and len(items) > limit:
                raise ValueError(
                    f"the prompt has {len(items)} {name}s, more than the {limit} per prompt this "
                    f"server allows (limit_mm_per_prompt['{name}'] / --limit-mm-per-prompt)"
                )
        return images, videos

    def accept_processed(
        self, prompt: ProcessedImagePrompt, params: SamplingParams
    ) -> tuple[str | None, list[int], dict[str, Any]]:
        """A front end's processed prompt, its token ids checked again against this engine."""
        validate_request(
            self.model_config, self.tokenizer, {"prompt_token_ids": prompt.token_ids}, params
        )
        return prompt.text, prompt.token_ids, prompt.extra
