"""Every prefill of a step in one SDPA call: the torch backend's GPU prefill path.

Per-sequence calls cost ~10 kernel launches each, per layer: on an H100 a step with 16
prefills spent 436 ms of CPU in attention for 28 layers. Here queries are padded into
`[prefills, longest query]`, keys gathered from the cache (this step's were written there
first) through the block tables, and one mask per sequence says which keys each query sees:
causal from its position (or anywhere in its own image, for Gemma 3's image spans), inside the
sliding window, within the sequence. Padded query rows see key 0 only (never an empty row) and
are dropped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tokenwise.attention.backends.image_mask import same_span
from tokenwise.attention.backends.kv_quant import dequantize, gather_rows
from tokenwise.attention.backends.softcap import softcapped_attention

if TYPE_CHECKING:
    from tokenwise.attention.metadata import AttentionMetadata


def packed_prefill(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    md: AttentionMetadata,
    output: torch.Tensor,
    *,
    num_kv_heads: int,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sinks: torch.Tensor | None = None,
) -> None:
    """Attend the prefill queries `q` (`[tokens, heads, head]`) into `output[:tokens]`;
    `sinks` (`[heads]`, gpt-oss) join each head's softmax denominator."""
    num_heads, head_size = q.shape[1], q.shape[2]
    num, block_size, dev = md.num_prefills, md.block_size, q.device
    q_lens = torch.tensor(md.query_lens[:num], device=dev)
    ctx = torch.tensor(md.context_lens[:num], device=dev)
    key_offset = torch.tensor(md.block_table_first_block[:num], device=dev) * block_size
    n_keys = ctx + q_lens - key_offset
    max_q = max(md.query_lens[:num])
    tables = md.block_tables[:num].to(torch.int64)
    width = tables.shape[1] * block_size
    flat = tables.reshape(-1)
    shape = (num, width, num_kv_heads, head_size)
    # An fp8 cache is dequantized as it is gathered (`kv_quant.py`).
    keys = dequantize(gather_rows(key_cache, flat), q.dtype, k_scale).view(shape).transpose(1, 2)
    values = dequantize(gather_rows(value_cache, flat), q.dtype, v_scale)
    values = values.view(shape).transpose(1, 2)
    # Query token t of sequence s goes to row s * max_q + (t - start of s).
    starts = torch.cumsum(q_lens, 0) - q_lens
    owner = torch.repeat_interleave(torch.arange(num, device=dev), q_lens)
    local = torch.arange(q.shape[0], device=dev) - starts[owner]
    rows = owner * max_q + local
    padded = q.new_zeros(num * max_q, num_heads, head_size)
    padded.index_copy_(0, rows, q)
    i = torch.arange(max_q, device=dev)[None, :, None]
    j = torch.arange(width, device=dev)[None, None, :]
    q_pos = ctx[:, None, None] + i
    k_pos = key_offset[:, None, None] + j
    seen = k_pos <= q_pos
    spans = md.bidirectional_spans
    if spans and any(spans[:num]):  # Gemma 3: an image's tokens see each other
        seen |= torch.stack([same_span(q_pos[r], k_pos[r], spans[r]) for r in range(num)])
    mask = (j < n_keys[:, None, None]) & seen
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    mask |= (i >= q_lens[:, None, None]) & (j == 0)
    queries = padded.view(num, max_q, num_heads, head_size).transpose(1, 2)
    if softcap or sinks is not None:
        out = softcapped_attention(
            queries, keys, values, scale=scale, softcap=softcap, mask=mask, sinks=sinks
        )
    else:
        out = F.scaled_dot_product_attention(
            queries,
            keys,
            values,
            attn_mask=mask[:, None],
            scale=scale,
            enable_gqa=num_heads > num_kv_heads,
        )
    out = out.transpose(1, 2).reshape(num * max_q, num_heads, head_size)
    output[: q.shape[0]] = out.index_select(0, rows)
