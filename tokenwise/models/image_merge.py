"""Image rows in place of their placeholder tokens' text embeddings, then the decoder.

The one step every vision-language model here shares (LLaVA, Gemma 3, Qwen2.5-VL): the runner
hands the model this step's image embedding rows and the flat indices of the placeholder
tokens they belong to; the model embeds the text, overwrites those rows, and runs its decoder
on the merged embeddings. A step without image rows runs the decoder on the token ids, so a
text-only step costs nothing extra. Only the text embedding differs between the models (Gemma
3's placeholder id lies past its text vocabulary), so that is what a model may pass in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def images_turned_off(limit_mm_per_prompt: dict[str, int] | None) -> bool:
    """`limit_mm_per_prompt={"image": 0}`: vLLM's "language model only" mode, in which a
    vision-language checkpoint that allows it (`text_only_without_images`) serves text alone,
    as its text model (no tower built; every feature of the text model, TP and speculative
    decoding included). A video limit above 0 keeps the tower (videos run through it)."""
    limits = limit_mm_per_prompt or {}
    return limits.get("image") == 0 and not limits.get("video")  # a video needs the tower


def serves_text_only(model_cls: Any, limit_mm_per_prompt: dict[str, int] | None) -> bool:
    return bool(getattr(model_cls, "text_only_without_images", False)) and images_turned_off(
        limit_mm_per_prompt
    )


def decode_with_images(
    decoder: torch.nn.Module,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    image_embeds: torch.Tensor | None,
    image_token_rows: torch.Tensor | None,
    embed_text: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """`decoder(input_ids, positions)`, with `image_embeds[i]` replacing the text embedding of
    flat token `image_token_rows[i]` (cast to the text embeddings' dtype). `embed_text`: how
    the model embeds token ids; by default the decoder's `embed_tokens`."""
    if image_embeds is None or image_token_rows is None:
        return decoder(input_ids, positions)
    embeds = (embed_text or decoder.embed_tokens)(input_ids)
    embeds = embeds.index_copy(0, image_token_rows, image_embeds.to(embeds.dtype))
    return decoder(input_ids, positions, inputs_embeds=embeds)
