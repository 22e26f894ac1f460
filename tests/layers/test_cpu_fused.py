"""The C RMSNorm and RoPE kernels (`tokenwise.native.fused`) against the torch code of
`RMSNorm` and `RotaryEmbedding` they stand in for: bit for bit, in float32 and bfloat16."""

from __future__ import annotations

import platform

import pytest
import torch

from tokenwise.layers.layernorm import GemmaRMSNorm, RMSNorm
from tokenwise.layers.rotary_embedding import RotaryEmbedding
from tokenwise.native import fused as cpu_fused

pytestmark = pytest.mark.skipif(cpu_fused.load() is None, reason="no C compiler here")

DTYPES = [torch.float32, torch.bfloat16]
# The sum of squares follows ATen's x86 reduction order; elsewhere only closeness is promised.
X86 = platform.machine().lower() in ("x86_64", "amd64")


def _torch_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual=None):  # noqa: ANN001, ANN202
    """`RMSNorm`'s torch arithmetic (HF's rounding points), written out independently."""
    if residual is not None:
        x = x + residual
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)).to(x.dtype)
    return weight * normed, x


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    if X86:
        assert torch.equal(got, want), (got - want).abs().max()
    else:
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [7, 64, 100, 128, 768, 1024, 2048, 4096, 5120])
@pytest.mark.parametrize("rows", [1, 3])
def test_rms_norm_equals_torch(dtype: torch.dtype, size: int, rows: int) -> None:
    gen = torch.Generator().manual_seed(size * 10 + rows)
    for trial in range(4):
        scale = [0.01, 1.0, 30.0, 1000.0][trial]
        x = (torch.randn(rows, size, generator=gen) * scale).to(dtype)
        res = (torch.randn(rows, size, generator=gen) * scale).to(dtype)
        weight = (1 + 0.3 * torch.randn(size, generator=gen)).to(dtype)
        fused = cpu_fused.rms_norm(x, weight, 1e-6)
        assert fused is not None and fused[1] is None
        _same(fused[0], _torch_norm(x, weight, 1e-6)[0])
        fused = cpu_fused.rms_norm(x, weight, 1e-5, res)
        assert fused is not None and fused[1] is not None
        want_out, want_sum = _torch_norm(x, weight, 1e-5, res)
        assert torch.equal(fused[1], want_sum)
        _same(fused[0], want_out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [64, 256, 1024])
def test_gemma_rms_norm_equals_torch(dtype: torch.dtype, size: int) -> None:
    """Gemma's norm (checkpoint `weight - 1`, the scale applied in float32 before the cast):
    the kernel's `gemma` mode equals the module's torch arithmetic, written out here."""
    gen = torch.Generator().manual_seed(size)
    for scale in (0.01, 1.0, 30.0):
        x = (torch.randn(3, size, generator=gen) * scale).to(dtype)
        weight = (0.3 * torch.randn(size, generator=gen)).to(dtype)
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + 1e-6)
        want = (normed * (1.0 + weight.float())).to(dtype)
        fused = cpu_fused.rms_norm(x, weight, 1e-6, gemma=True)
        assert fused is not None and fused[1] is None
        _same(fused[0], want)
        norm = GemmaRMSNorm(size, 1e-6).to(dtype)
        norm.weight.data = weight
        _same(norm(x), want)  # the module takes the kernel for decode rows
        assert not torch.equal(fused[0], _torch_norm(x, weight, 1e-6)[0])  # not plain RMSNorm


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_module_same_with_and_without_kernel(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The module's fast path (decode rows) and its torch path (the kernel declined) agree;
    more rows than `MAX_ROWS` never reach the kernel."""
    gen = torch.Generator().manual_seed(3)
    norm = RMSNorm(768, 1e-5).to(dtype)
    norm.weight.data = (1 + 0.2 * torch.randn(768, generator=gen)).to(dtype)
    x, res = (torch.randn(2, 768, generator=gen).to(dtype) for _ in range(2))
    fast_out, fast_sum = norm(x, res)
    monkeypatch.setattr(cpu_fused, "rms_norm", lambda *args: None)
    slow_out, slow_sum = norm(x, res)
    _same(fast_out, slow_out)
    assert torch.equal(fast_sum, slow_sum)
    big = torch.randn(cpu_fused.MAX_ROWS + 1, 768, dtype=dtype)
    monkeypatch.undo()
    assert cpu_fused.rms_norm(big, norm.weight, 1e-5) is None


def test_rms_norm_declines_what_it_does_not_handle() -> None:
    x = torch.randn(2, 64)
    assert cpu_fused.rms_norm(x.half(), torch.ones(64).half(), 1e-6) is None
    assert cpu_fused.rms_norm(x, torch.ones(64, dtype=torch.bfloat16), 1e-6) is None
    assert cpu_fused.rms_norm(x.t(), torch.ones(2), 1e-6) is None  # not contiguous
    assert cpu_fused.rms_norm(x.requires_grad_(), torch.ones(64), 1e-6) is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 80])
@pytest.mark.parametrize("tokens", [1, 5])
def test_rope_equals_torch(
    dtype: torch.dtype, head_dim: int, tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """q and k as strided views of one fused qkv row, as a decoder layer passes them."""
    gen = torch.Generator().manual_seed(head_dim + tokens)
    rope = RotaryEmbedding(
        head_dim,
        4096,
        10000.0,
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    )
    heads, kv_heads = 4, 2
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen) * 3).to(dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    fast_q, fast_k = rope(positions, q, k)
    assert fast_q.is_contiguous() and fast_q.shape == q.shape
    monkeypatch.setattr(cpu_fused, "rope_neox", lambda *args: None)
    slow_q, slow_k = rope(positions, q, k)
    assert torch.equal(fast_q, slow_q)
    assert torch.equal(fast_k, slow_k)
    # 3-D heads (Qwen3 after its q/k norms) take the kernel too, with the same result.
    monkeypatch.undo()
    q3, k3 = q.reshape(tokens, heads, head_dim), k.reshape(tokens, kv_heads, head_dim)
    out = cpu_fused.rope_neox(positions, q3, k3, rope.cos_sin_cache, head_dim)
    assert out is not None and out[0].shape == q3.shape and out[1].shape == k3.shape
    assert torch.equal(out[0].flatten(1), slow_q)
    assert torch.equal(out[1].flatten(1), slow_k)


def test_rope_kernel_is_not_used_for_interleaved_pairs_or_prefill() -> None:
    x = torch.randn(cpu_fused.MAX_ROWS + 1, 64)
    rope = RotaryEmbedding(64, 128, is_neox_style=False)
    positions = torch.zeros(x.shape[0], dtype=torch.int64)
    too_many = cpu_fused.rope_neox(positions, x, x, rope.cos_sin_cache, 64)
    assert too_many is None  # a prefill chunk: torch's ops
    q, k = rope(positions[:1], x[:1], x[:1])  # interleaved: the torch path, still correct
    assert torch.equal(q, x[:1])  # position 0 rotates by nothing


@pytest.mark.parametrize("rows", [1, 4])
def test_argmax_equals_torch_on_ties_and_nan(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    for width in (1, 5, 32000, 151936):
        x = torch.randn(rows, width, generator=gen)
        assert torch.equal(cpu_fused.argmax(x), x.argmax(dim=-1))
        # Ties: several equal maxima, coarse values; the first index wins in both.
        coarse = torch.randint(0, 4, (rows, width), generator=gen).float()
        assert torch.equal(cpu_fused.argmax(coarse), coarse.argmax(dim=-1))
    x = torch.randn(rows, 100, generator=gen)
    x[0, 37] = float("nan")
    x[0, 60] = float("nan")
    x[-1, 0] = float("inf")
    assert torch.equal(cpu_fused.argmax(x), x.argmax(dim=-1))
    assert int(cpu_fused.argmax(x)[0]) == 37


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [1, 100, 256, 300, 2048])
@pytest.mark.parametrize("rows", [1, 5])
def test_silu_and_mul_equals_torch_within_a_rounding(dtype: torch.dtype, d: int, rows: int) -> None:
    """silu(gate) * up as torch rounds it; the exponential is a polynomial, so silu may differ
    by a float32 ulp and its bf16 rounding (rarely) by one bf16 ulp."""
    x = (torch.randn(rows, 2 * d, generator=torch.Generator().manual_seed(d)) * 6).to(dtype)
    x[0, :4] = torch.tensor([0.0, -100.0, 100.0, -20.0], dtype=dtype)[: min(4, 2 * d)]
    gate, up = x.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate).mul_(up)
    got = cpu_fused.silu_and_mul(x)
    assert got is not None and got.shape == want.shape and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-30)
    else:  # one bf16 ulp of silu, times up, then the product's own rounding
        bound = (want.float().abs() * 2**-7 + 1e-30).max()
        assert (got.float() - want.float()).abs().max() <= bound
        assert (got == want).float().mean() > 0.99  # most values are the same bits


def test_silu_and_mul_declines_prefill_sizes_odd_widths_and_strided_rows() -> None:
    assert cpu_fused.silu_and_mul(torch.randn(cpu_fused.MAX_ROWS + 1, 8)) is None
    assert cpu_fused.silu_and_mul(torch.randn(2, 7)) is None
    assert cpu_fused.silu_and_mul(torch.randn(2, 16)[:, :8]) is None
    assert cpu_fused.silu_and_mul(torch.randn(2, 8, dtype=torch.float16)) is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding_rows_equal_torch(dtype: torch.dtype) -> None:
    table = torch.randn(50, 24).to(dtype)
    ids = torch.tensor([3, 0, 49, 3])
    got = cpu_fused.embedding_rows(ids, table)
    assert got is not None and torch.equal(got, torch.nn.functional.embedding(ids, table))
    assert cpu_fused.embedding_rows(ids.to(torch.int32), table) is None
    assert cpu_fused.embedding_rows(torch.arange(cpu_fused.MAX_ROWS + 1), table) is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_reads_strided_heads_of_a_fused_projection(dtype: torch.dtype) -> None:
    """Qwen3's per-head q/k norms read [tokens, heads, head_dim] views of the fused qkv output
    (token rows wider than the heads): same values as on a contiguous copy."""
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(5, 16 * 8 + 2 * 4 * 8, generator=gen).to(dtype)
    weight = (1 + 0.3 * torch.randn(8, generator=gen)).to(dtype)
    q, k, _ = qkv.split([16 * 8, 4 * 8, 4 * 8], dim=-1)
    for view in (q.reshape(5, 16, 8), k.reshape(5, 4, 8), q[:, :8]):
        assert not view.is_contiguous()
        fused = cpu_fused.rms_norm(view, weight, 1e-6)
        assert fused is not None and fused[0].is_contiguous()
        _same(fused[0], _torch_norm(view.contiguous(), weight, 1e-6)[0])
    assert cpu_fused.rms_norm(qkv.reshape(5, 24, 8)[:, ::2], weight, 1e-6) is None  # gaps
