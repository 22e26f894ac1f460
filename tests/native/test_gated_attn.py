"""The gated-attention glue kernels (`native/gated_attn.c`) against the torch code they stand
for in `GatedAttention` / `HybridDecoderLayer` (Qwen3.5, Qwen3-Next): zero-centred per-head
norms of q and k with partial neox RoPE, the sigmoid output gate, the residual add; and the
layouts and sizes they decline (the caller then runs torch)."""

from __future__ import annotations

import pytest
import torch

from tokenwise.layers import RotaryEmbedding
from tokenwise.native import fused, gated_attn

pytestmark = pytest.mark.skipif(gated_attn.load() is None, reason="no C compiler")

HEADS, KV_HEADS, D, ROT = 4, 2, 32, 8  # rotary over a quarter of each head (Qwen3.5's factor)


def _inputs(dtype: torch.dtype, tokens: int = 3):
    gen = torch.Generator().manual_seed(3)
    width = (2 * HEADS + 2 * KV_HEADS) * D
    qkv = (torch.randn(tokens, width + 5, generator=gen) * 2).to(dtype)[:, :width]  # strided
    q_w, k_w = (torch.randn(D, generator=gen) * 0.3).to(dtype), torch.zeros(D, dtype=dtype)
    rope = RotaryEmbedding(ROT, 64, 10000.0, None)
    positions = torch.tensor([5, 0, 63][:tokens])
    return qkv, q_w, k_w, rope, positions


def _torch_qk(qkv, q_w, k_w, rope, positions, eps):
    n, dtype = qkv.shape[0], qkv.dtype

    def norm(x, w):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
        return (x32 * (1.0 + w.float())).to(dtype)

    def rotate(x):
        cos, sin = rope.cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
        cos, sin = cos.to(dtype)[:, None], sin.to(dtype)[:, None]
        x1, x2 = x[..., : ROT // 2], x[..., ROT // 2 : ROT]
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        return torch.cat([rotated, x[..., ROT:]], dim=-1).reshape(n, -1)

    q = norm(qkv[:, : 2 * HEADS * D].reshape(n, HEADS, 2, D)[:, :, 0], q_w)
    k = norm(qkv[:, 2 * HEADS * D : (2 * HEADS + KV_HEADS) * D].reshape(n, KV_HEADS, D), k_w)
    return rotate(q), rotate(k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q_and_k_norm_and_partial_rope_equal_torch(dtype: torch.dtype) -> None:
    qkv, q_w, k_w, rope, positions = _inputs(dtype)
    got = gated_attn.gated_qk(
        qkv, positions, rope.cos_sin_cache, q_w, k_w, 1e-6, (HEADS, KV_HEADS, D, ROT)
    )
    assert got is not None
    want = _torch_qk(qkv, q_w, k_w, rope, positions, 1e-6)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.is_contiguous()
        torch.testing.assert_close(g, w)  # the dtype's tolerance: the norm sums in order


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sigmoid_gate_and_add_equal_torch(dtype: torch.dtype) -> None:
    qkv, *_ = _inputs(dtype)
    attn = torch.randn(3, HEADS * D).to(dtype)
    gate = qkv[:, : 2 * HEADS * D].reshape(3, HEADS, 2, D)[:, :, 1].reshape(3, -1)
    got = gated_attn.sigmoid_gate(attn, qkv, HEADS, D)
    assert got is not None
    torch.testing.assert_close(got, attn * torch.sigmoid(gate))
    other = torch.randn(3, HEADS * D).to(dtype)
    added = gated_attn.add(attn, other)
    assert added is not None and torch.equal(added, attn + other)


def test_what_the_kernels_decline() -> None:
    qkv, q_w, k_w, rope, positions = _inputs(torch.float32)
    heads = (HEADS, KV_HEADS, D, ROT)
    many = torch.zeros(fused.MAX_ROWS + 1, qkv.shape[1])
    assert gated_attn.gated_qk(many, positions, rope.cos_sin_cache, q_w, k_w, 1e-6, heads) is None
    half = qkv.half()
    assert gated_attn.gated_qk(half, positions, rope.cos_sin_cache, q_w, k_w, 1e-6, heads) is None
    assert (
        gated_attn.gated_qk(qkv, positions.int(), rope.cos_sin_cache, q_w, k_w, 1e-6, heads) is None
    )
    mrope = positions.expand(3, -1).contiguous()  # [3, T]: multimodal RoPE's sections
    assert gated_attn.gated_qk(qkv, mrope, rope.cos_sin_cache, q_w, k_w, 1e-6, heads) is None
    wrong_rot = (HEADS, KV_HEADS, D, ROT * 2)  # the table's rows are ROT wide
    assert (
        gated_attn.gated_qk(qkv, positions, rope.cos_sin_cache, q_w, k_w, 1e-6, wrong_rot) is None
    )
    a = torch.zeros(2, 8)
    assert gated_attn.add(a, torch.zeros(2, 8, dtype=torch.bfloat16)) is None
    assert gated_attn.add(a.t(), a.t()) is None
    assert gated_attn.sigmoid_gate(torch.zeros(8, 2).t(), qkv, 1, 1) is None
