"""Attention with logit soft-capping, written out (Gemma 2's `attn_logit_softcapping`).

Soft-capping squashes every score through `cap * tanh(score / cap)` before the softmax, which
keeps logits of a deep model bounded. `scaled_dot_product_attention` has no hook between the
scores and the softmax, so layers that cap take this explicit formulation instead: one score
matmul, the cap, a boolean mask, a float32 softmax (as transformers' eager path does) and one
value matmul. Grouped-query heads are handled by viewing the query heads as
`[kv_heads, group]`, so KV heads are broadcast, never copied per query head.

Attention sinks (gpt-oss) need the same hook: one learned logit per head joins the softmax
as an extra column with no value, so it only enlarges the denominator (a head may then give
little weight to every key). SDPA cannot add it either, so sink layers take this path too,
with or without a cap.
"""

from __future__ import annotations

import torch


def soft_cap(scores: torch.Tensor, cap: float) -> torch.Tensor:
    """`cap * tanh(scores / cap)`: near identity for small scores, bounded by +-cap."""
    return torch.tanh(scores / cap) * cap


def softcapped_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    scale: float,
    softcap: float | None,
    mask: torch.Tensor | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of `query [*b, heads, q, d]` over `key`/`value [*b, kv_heads, k, d]`.

    `mask` (bool, True = visible) is `[*b, q, k]` or `[q, k]`; every query row must see at
    least one key. `softcap` None: no cap. `sinks` `[heads]`: each head's sink logit, in the
    denominator only. Returns `[*b, heads, q, d]` in the query's dtype.
    """
    *batch, num_heads, q_len, head_size = query.shape
    num_kv_heads, k_len = key.shape[-3], key.shape[-2]
    group = num_heads // num_kv_heads
    qg = query.reshape(*batch, num_kv_heads, group * q_len, head_size)
    scores = torch.matmul(qg, key.transpose(-1, -2)).float() * scale
    if softcap:
        scores = soft_cap(scores, softcap)
    scores = scores.view(*batch, num_kv_heads, group, q_len, k_len)
    if mask is not None:
        scores = scores.masked_fill(~mask[..., None, None, :, :], float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(num_kv_heads, group, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        probs = probs.to(value.dtype)
    else:
        probs = torch.softmax(scores, dim=-1).to(value.dtype)
    probs = probs.view(*batch, num_kv_heads, group * q_len, k_len)
    out = torch.matmul(probs, value)
    return out.view(*batch, num_heads, q_len, head_size).to(query.dtype)


def causal_mask(
    q_positions: torch.Tensor, k_positions: torch.Tensor, sliding_window: int | None
) -> torch.Tensor:
    """Which keys each query sees: earlier-or-same positions, inside the window when one is set."""
    q_pos, k_pos = q_positions[:, None], k_positions[None, :]
    visible = k_pos <= q_pos
    if sliding_window is not None:
        visible &= k_pos > q_pos - sliding_window
    return visible
