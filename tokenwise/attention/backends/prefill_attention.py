"""Causal attention of one prefill's queries over its keys: the torch backend's prefill path.

Queries at positions `ctx_len..` attend to keys at positions `offset..` (a sliding window's
table starts past the first blocks), causally, within the window, and both ways inside each
image span (Gemma 3); soft-capped logits and attention sinks (gpt-oss) take the explicit path,
everything else one SDPA call with a batch dimension of one (see the note at the call).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from tokenwise.attention.backends.image_mask import Span, visible_keys
from tokenwise.attention.backends.softcap import causal_mask, softcapped_attention


def attend_prefill(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    ctx_len: int,
    offset: int,
    spans: Sequence[Span] = (),
    *,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
    gqa: bool,
) -> torch.Tensor:
    """Causal attention of queries at positions ctx_len.. over keys at offset.. (and
    bidirectional within each of `spans`, an image's positions)."""
    q_len, n_keys = q.shape[0], keys.shape[0]
    if softcap or spans or sinks is not None:
        dev = q.device
        q_pos = torch.arange(ctx_len, ctx_len + q_len, device=dev)
        k_pos = torch.arange(offset, offset + n_keys, device=dev)
        if spans:
            visible = visible_keys(q_pos, k_pos, spans, sliding_window)
        else:
            visible = causal_mask(q_pos, k_pos, sliding_window)
        if not softcap and sinks is None:
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None],
                keys.transpose(0, 1)[None],
                values.transpose(0, 1)[None],
                attn_mask=visible,
                scale=scale,
                enable_gqa=gqa,
            )
            return out[0].transpose(0, 1)
        out = softcapped_attention(
            q.transpose(0, 1),
            keys.transpose(0, 1),
            values.transpose(0, 1),
            scale=scale,
            softcap=softcap,
            mask=visible,
            sinks=sinks,
        )
        return out.transpose(0, 1)
    mask: torch.Tensor | None = None
    is_causal = False
    if sliding_window is not None:
        q_pos = torch.arange(ctx_len, ctx_len + q_len, device=q.device)[:, None]
        k_pos = torch.arange(offset, offset + n_keys, device=q.device)[None, :]
        mask = (k_pos <= q_pos) & (k_pos > q_pos - sliding_window)
    elif n_keys == q_len:
        is_causal = True
    else:
        mask = causal_lower_right(q_len, n_keys)  # type: ignore[assignment]
    # A batch dimension of one: with 3-D inputs SDPA never takes its CPU flash kernel and
    # runs the unfused math path instead (measured 2-3.4x slower on 200-300 tokens).
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        keys.transpose(0, 1)[None],
        values.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=gqa,
    )
    return out[0].transpose(0, 1)
