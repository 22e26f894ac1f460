"""Attention over one sequence with no KV cache, in plain PyTorch (causal unless told).

Three callers need exactly this and nothing more: the `Attention` layer when there is no forward
context (a model used on its own, like a plain PyTorch module), a backend on a pass without
metadata (the engine's profiling and warm-up passes), and encoder-only attention, which runs
each sequence of its step through it with `causal=False`. It lives in its own module below both, so
that the backend takes its settings as plain values and never imports the layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenwise.attention.backends.softcap import causal_mask, softcapped_attention


def single_sequence_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    causal: bool = True,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """All tokens are one sequence: q `[n, heads * head]`, k/v `[n, kv_heads * head]`.

    `causal=False` lets every token see every other (encoder-only models); a window needs
    causal attention.

    Returns `[n, heads * head]`. Grouped-query attention is SDPA's `enable_gqa`, so KV heads
    are never repeated; a sliding window becomes an explicit band mask, and soft-capped scores
    and attention sinks (`[heads]` logits, gpt-oss) take the explicit formulation of
    `softcap.py`.
    """
    num_tokens = query.shape[0]
    q = query.view(num_tokens, num_heads, head_size).transpose(0, 1)
    k = key.view(num_tokens, num_kv_heads, head_size).transpose(0, 1)
    v = value.view(num_tokens, num_kv_heads, head_size).transpose(0, 1)
    if softcap or sinks is not None:
        pos = torch.arange(num_tokens, device=query.device)
        mask = causal_mask(pos, pos, sliding_window) if causal else None
        out = softcapped_attention(q, k, v, scale=scale, softcap=softcap, mask=mask, sinks=sinks)
        return out.transpose(0, 1).reshape(num_tokens, num_heads * head_size)
    mask = None
    if sliding_window is not None and not causal:
        raise ValueError("a sliding window needs causal attention")
    if sliding_window is not None:
        pos = torch.arange(num_tokens, device=query.device)
        diff = pos[:, None] - pos[None, :]
        mask = (diff >= 0) & (diff < sliding_window)
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        is_causal=causal and mask is None,
        scale=scale,
        enable_gqa=num_kv_heads != num_heads,
    )
    return out.transpose(0, 1).reshape(num_tokens, num_heads * head_size)
