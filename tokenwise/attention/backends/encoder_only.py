"""Bidirectional attention of encoder-only models (BERT): every token sees its whole sequence.

An encoder-only step is all prompts and no cache: each sequence is attended in full, once, and
its keys and values are never needed again (the next request is a different text). So nothing
is written to or read from a KV cache here, and the only batch structure needed is where each
sequence starts and ends, taken from the step's metadata (`query_lens`, host-side, so the CPU
path never reads a device tensor).

Two formulations with the same result: one SDPA call per sequence (the CPU path, as for decoder
prefills: no padding work), and one padded call with a block-diagonal mask (the GPU path: per
sequence calls cost a handful of kernel launches each, per layer).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from tokenwise.attention.backends.single_sequence import single_sequence_attention
from tokenwise.attention.utils import AttentionType, get_num_prefill_decode_query_kv_tokens

if TYPE_CHECKING:
    from tokenwise.attention.metadata import AttentionMetadata


def encoder_only_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_metadata: AttentionMetadata | None,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    scale: float,
    packed: bool | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """Attention within each sequence of the step; `[num_tokens, heads * head]`.

    Without metadata (a model used on its own, or a warm-up pass) all tokens are one sequence.
    `packed` picks the padded single call (default: on any device but the CPU). `causal`: each
    token sees only those before it (a decoder classifying whole prompts), else all of them.
    """
    settings = {
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "head_size": head_size,
        "scale": scale,
    }
    if attn_metadata is None:
        return single_sequence_attention(query, key, value, causal=causal, **settings)
    # A one-token prompt counts as a "decode" in the metadata's split; here it is a whole
    # sequence like any other, so only the total matters.
    num_prefill, _, num_decode = get_num_prefill_decode_query_kv_tokens(
        attn_metadata, AttentionType.ENCODER_ONLY
    )
    num_tokens = query.shape[0]
    if num_prefill + num_decode != num_tokens:
        raise ValueError(
            f"metadata covers {num_prefill + num_decode} tokens, the step has {num_tokens}"
        )
    if any(attn_metadata.context_lens):
        raise ValueError(
            "encoder-only attention runs whole prompts with no cache, but the step has "
            f"context lengths {attn_metadata.context_lens} (a chunked prompt?)"
        )
    lens = attn_metadata.query_lens
    return attend_within_sequences(query, key, value, lens, packed, causal, **settings)


def attend_within_sequences(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    lens: list[int],
    packed: bool | None = None,
    causal: bool = False,
    **settings: Any,
) -> torch.Tensor:
    """Attention within each of the consecutive sequences of lengths `lens` (bidirectional
    unless `causal`).

    Shared by encoder-only models (lengths from the step's queries) and the encoders of
    encoder-decoder models (lengths of the encoders that run this step).
    """
    if packed is None:
        packed = query.device.type != "cpu"
    if packed and len(lens) > 1:
        return _packed(query, key, value, lens, causal, **settings)
    out = torch.empty_like(query)
    start = 0
    for n in lens:
        end = start + n
        out[start:end] = single_sequence_attention(
            query[start:end], key[start:end], value[start:end], causal=causal, **settings
        )
        start = end
    return out


def _packed(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    lens: list[int],
    causal: bool,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    scale: float,
) -> torch.Tensor:
    """All sequences in one SDPA call: padded to the longest, keys masked to their sequence.

    Padded query rows see key 0 of their row (never an all-masked row, which gives NaN) and
    are dropped when the rows are gathered back. `causal` also hides later keys.
    """
    dev = query.device
    num, longest = len(lens), max(lens)
    q_lens = torch.tensor(lens, device=dev)
    owner = torch.repeat_interleave(torch.arange(num, device=dev), q_lens)
    starts = torch.cumsum(q_lens, 0) - q_lens
    rows = owner * longest + torch.arange(query.shape[0], device=dev) - starts[owner]

    def pad(x: torch.Tensor, heads: int) -> torch.Tensor:
        padded = x.new_zeros(num * longest, heads, head_size)
        padded.index_copy_(0, rows, x.view(-1, heads, head_size))
        return padded.view(num, longest, heads, head_size).transpose(1, 2)

    pos = torch.arange(longest, device=dev)
    real = pos[None, :] < q_lens[:, None]  # [num, longest]
    keys = real[:, None, :]  # [num, query, key]
    if causal:
        keys = keys & (pos[None, None, :] <= pos[None, :, None])
    mask = keys | ((pos[None, None, :] == 0) & ~real[:, :, None])
    out = F.scaled_dot_product_attention(
        pad(query, num_heads),
        pad(key, num_kv_heads),
        pad(value, num_kv_heads),
        attn_mask=mask[:, None],
        scale=scale,
        enable_gqa=num_kv_heads != num_heads,
    )
    out = out.transpose(1, 2).reshape(num * longest, num_heads * head_size)
    return out.index_select(0, rows)
