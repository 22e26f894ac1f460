"""Bidirectional attention within an image, on top of a causal (and windowed) prefill mask.

Gemma 3 lets the soft tokens of one image see each other both ways, as HF's
`token_type_ids` mask does: key k is visible to query q when (k <= q OR q and k lie in the same
image) AND, in a sliding layer, k > q - window. Other tokens (text, decode steps) keep the
causal mask, so the backends only take this path for prefill rows whose metadata lists image
spans (`AttentionMetadata.bidirectional_spans`, set by the multimodal runner).

A model may name the layers that follow the rule (Gemma 4: only its sliding layers; its global
layers stay causal): `put_image_spans` then sets the spans on those layers' metadata alone.

Spans are `(start, end)` prompt positions of one image's soft tokens; the scheduler keeps an
image's queries in one chunk, so every key such a query may see is in the cache or in this
step's K/V, which the backend writes before it attends.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import torch

Span = tuple[int, int]


def same_span(q_pos: torch.Tensor, k_pos: torch.Tensor, spans: Sequence[Span]) -> torch.Tensor:
    """`[..., q, k]` bool: query and key positions inside one common span.

    `q_pos` broadcasts as `[..., q, 1]` and `k_pos` as `[..., 1, k]`, so one call serves a
    single sequence's mask and a padded batch row alike.
    """
    shape = torch.broadcast_shapes(q_pos.shape, k_pos.shape)
    out = torch.zeros(shape, dtype=torch.bool, device=q_pos.device)
    for start, end in spans:
        out |= (q_pos >= start) & (q_pos < end) & (k_pos >= start) & (k_pos < end)
    return out


def visible_keys(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    spans: Sequence[Span],
    sliding_window: int | None,
) -> torch.Tensor:
    """`[q, k]` bool: (causal OR same image) AND inside the window (Gemma 3's image mask)."""
    q, k = q_pos[:, None], k_pos[None, :]
    mask = (k <= q) | same_span(q, k, spans)
    if sliding_window is not None:
        mask &= k > q - sliding_window
    return mask


def put_image_spans(
    attn_metadata: dict[str, Any],
    spans: list[list[Span]],
    layers: Collection[str] | None = None,
) -> None:
    """Set each prefill row's image spans on the step's metadata (one object per KV-cache
    group, keyed by layer name): every group's, or only those of the named `layers`. A group
    holding layers of both kinds cannot say two things, so it is refused."""
    if layers is None:
        picked = {id(md): md for md in attn_metadata.values()}
    else:
        picked = {id(md): md for name, md in attn_metadata.items() if name in layers}
        causal = {id(md) for name, md in attn_metadata.items() if name not in layers}
        if picked.keys() & causal:
            raise ValueError(
                "a KV-cache group holds layers that attend over images both ways and layers "
                "that attend causally; their attention metadata cannot differ"
            )
    for md in picked.values():
        md.bidirectional_spans = spans
