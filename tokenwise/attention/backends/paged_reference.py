"""Decode attention over a paged cache in plain PyTorch: the reference every decode path matches.

One padded, batched gather of each sequence's blocks and a grouped-query matmul. It reads only
device tensors (no host sync), so it is also the graph-safe decode of the GPU backends where no
kernel applies (soft-capped layers), and what the Triton kernel and the C kernel are tested
against.
"""

from __future__ import annotations

import torch

from tokenwise.attention.backends.kv_quant import dequantize, gather_rows
from tokenwise.attention.backends.softcap import soft_cap


def paged_decode_reference(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    first_block: torch.Tensor | None = None,
    softcap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged keys, in plain PyTorch.

    q `[n, heads, head]`; caches `[blocks, block_size, kv_heads, head]`; `block_tables[i, j]` is
    the cache block of the sequence's logical block `first_block[i] + j` (0 when not given);
    `seq_lens[i]` counts the keys of sequence i, this step's included. No host reads. An fp8
    cache is read as stored * `k_scale` / `v_scale` (`kv_quant.py`). `sinks` `[heads]`
    (gpt-oss): one logit per head that joins the softmax denominator and carries no value.
    """
    n, num_heads, head_size = q.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    width = block_tables.shape[1] * block_size
    flat = block_tables.reshape(-1).to(torch.int64)
    shape = (n, width, num_kv_heads, head_size)
    keys = dequantize(gather_rows(key_cache, flat), torch.float32, k_scale).view(shape)
    values = dequantize(gather_rows(value_cache, flat), torch.float32, v_scale).view(shape)
    qg = q.view(n, num_kv_heads, group, head_size)
    scores = torch.matmul(qg.float(), keys.permute(0, 2, 3, 1).float()) * scale
    if softcap:
        scores = soft_cap(scores, softcap)
    key_pos = torch.arange(width, device=q.device)[None, :]
    if first_block is not None:
        key_pos = key_pos + first_block.to(torch.int64)[:, None] * block_size
    lens = seq_lens.to(torch.int64)[:, None]
    visible = key_pos < lens
    if sliding_window is not None:
        visible = visible & (key_pos >= lens - sliding_window)
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, num_kv_heads, group, 1).expand(n, -1, -1, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, values.permute(0, 2, 1, 3).float())
    return out.reshape(n, num_heads, head_size).to(q.dtype)
