"""Triton paged-attention decode: one query token per sequence over its KV blocks.

One program per (sequence, KV head). It loads the queries of all heads that share that KV head
(grouped-query attention reads each K/V block once for the whole group, padded to the 16 rows a
tensor-core `tl.dot` needs), walks the sequence in tiles of `TILE` tokens that span several
cache blocks (one gather of block ids per tile: on an H100 a walk of one 16-token block per
iteration was latency-bound, 65% of a decode step), and keeps an online softmax (running max,
running sum, rescaled accumulator) in fp32, so nothing of size `seq_len` is ever materialised.
fp32 caches use IEEE dots (no TF32), so fp32 results match the PyTorch reference. A sliding
window starts the walk at the first block the window reaches and masks the keys before it.
An fp8 cache (`kv_quant.py`) is loaded as fp8 and converted to the queries' dtype in registers
(half a bf16 cache's bytes); `k_scale` is folded into the score scale and `v_scale` into the
output. Not yet run on a GPU: written from Triton's fp8 types, reviewed, untested on hardware.

Everything the kernel reads is on the device (`block_tables`, `seq_lens`, optional
`first_block`), and the launch depends only on shapes, so a decode step that calls it can be
captured in a CUDA graph and replayed on new metadata written into the same buffers.

Imported only when Triton is available (never a tokenwise dependency); the PyTorch reference
with the same signature is `triton_backend.paged_decode_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    first_block_ptr,
    sinks_ptr,
    scale,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_c_block,
    stride_c_tok,
    stride_c_head,
    stride_bt_seq,
    sliding_window,
    v_scale,
    FP8: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_FIRST_BLOCK: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    IEEE: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_PAD)
    j = tl.arange(0, TILE)
    d_mask = d < HEAD_SIZE
    heads = kv_head * GROUP + g
    q_offsets = seq * stride_q_tok + heads[:, None] * stride_q_head + d[None, :]
    q_mask = (g < GROUP)[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + q_offsets, mask=q_mask, other=0.0)

    first = 0
    if HAS_FIRST_BLOCK:
        first = tl.load(first_block_ptr + seq).to(tl.int32)
    lo = first
    if HAS_WINDOW:
        lo = tl.maximum(lo, tl.maximum(seq_len - sliding_window, 0) // BLOCK_SIZE)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_PAD], tl.float32)
    for start in range(lo * BLOCK_SIZE, seq_len, TILE):
        pos = start + j
        in_seq = pos < seq_len
        blocks = tl.load(
            block_tables_ptr + seq * stride_bt_seq + (pos // BLOCK_SIZE - first),
            mask=in_seq,
            other=0,
        ).to(tl.int64)
        kv_offsets = (
            blocks[:, None] * stride_c_block
            + (pos % BLOCK_SIZE)[:, None] * stride_c_tok
            + kv_head * stride_c_head
            + d[None, :]
        )
        kv_mask = in_seq[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        if FP8:
            k = k.to(tl.float32).to(q_ptr.dtype.element_ty)
        if IEEE:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            scores = tl.dot(q, tl.trans(k)) * scale
        valid = in_seq
        if HAS_WINDOW:
            valid = valid & (pos >= seq_len - sliding_window)
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a tile wholly before the window
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        if FP8:
            v = v.to(tl.float32).to(q_ptr.dtype.element_ty)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    if HAS_SINKS:  # one more softmax column per head, with no value: rescale, widen the sum
        sink = tl.load(sinks_ptr + heads, mask=g < GROUP, other=0.0).to(tl.float32)
        m_fin = tl.maximum(m_i, sink)
        alpha = tl.exp(m_i - m_fin)
        l_i = l_i * alpha + tl.exp(sink - m_fin)
        acc = acc * alpha[:, None]
    l_i = tl.where(l_i == 0.0, 1.0, l_i)  # a row without keys (padding rows of a graph) gives 0
    out = acc / l_i[:, None]
    if FP8:
        out = out * v_scale
    o_offsets = seq * stride_o_tok + heads[:, None] * stride_o_head + d[None, :]
    tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_decode(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    first_block: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as `triton_backend.paged_decode_reference`; returns `[n, heads, head]`.

    `sinks` (`[heads]`, gpt-oss): folded in after the walk, as one more column of the online
    softmax with no value. Written and reviewed, not yet run on a GPU.
    """
    n, num_heads, head_size = q.shape
    _, block_size, num_kv_heads, cache_head_size = key_cache.shape
    if cache_head_size != head_size or num_heads % num_kv_heads:
        raise ValueError(
            f"query {tuple(q.shape)} does not fit a cache of {num_kv_heads} KV heads of size "
            f"{cache_head_size}"
        )
    if q.stride(-1) != 1 or key_cache.stride(-1) != 1 or key_cache.stride() != value_cache.stride():
        raise ValueError("paged_decode needs contiguous head dims and K/V caches of one layout")
    out = torch.empty_like(q)
    if n == 0:
        return out
    group = num_heads // num_kv_heads
    head_pad = max(16, triton.next_power_of_2(head_size))
    tile = max(16, min(128, 8192 // head_pad))  # ~16 KiB of bf16 K per iteration
    fp8 = key_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    if not fp8:
        k_scale = v_scale = 1.0  # scales belong to fp8 caches only (kv_quant.py)
    _paged_decode_kernel[(n, num_kv_heads)](
        out,
        q,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        seq_lens if first_block is None else first_block,
        seq_lens if sinks is None else sinks,
        scale * k_scale,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_tables.stride(0),
        sliding_window or 0,
        v_scale,
        FP8=fp8,
        HAS_WINDOW=sliding_window is not None,
        HAS_FIRST_BLOCK=first_block is not None,
        HAS_SINKS=sinks is not None,
        BLOCK_SIZE=block_size,
        TILE=tile,
        HEAD_SIZE=head_size,
        HEAD_PAD=head_pad,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),  # tl.dot needs 16 rows
        IEEE=q.dtype == torch.float32,
        num_warps=4,
    )
    return out
