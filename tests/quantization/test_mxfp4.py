"""MXFP4 (gpt-oss's expert format): our reading of the published bytes against transformers',
the quantizer the tests write checkpoints with, and the C kernel against dequantize + matmul
(the build for this CPU, its AVX2 + FMA path and the plain C one)."""

from __future__ import annotations

import pytest
import torch

from tokenwise.layers.quantization import mxfp4
from tokenwise.native import build as native_build
from tokenwise.native import mxfp4_gemv as kernel


def _random_weights(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every byte value, and scales from 2^-10 to 2^3 (a few rows very small or large)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n, k // 32, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(117, 131, (n, k // 32), generator=gen, dtype=torch.uint8)
    return blocks, scales


def test_dequantize_reads_the_bytes_as_transformers_does() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _random_weights(2 * 48, 64, seed=1)
    blocks, scales = blocks.view(2, 48, 2, 16), scales.view(2, 48, 2)  # [E, rows, G, 16]
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    ours = mxfp4.dequantize(blocks, scales, torch.float32)  # [E, out, in]
    assert torch.equal(ours, theirs.transpose(1, 2))


def test_quantize_round_trips_representable_values_and_bounds_the_error() -> None:
    blocks, scales = _random_weights(16, 128, seed=2)
    exact = mxfp4.dequantize(blocks, scales, torch.float32)
    again = mxfp4.dequantize(*mxfp4.quantize(exact), torch.float32)
    assert torch.equal(again, exact)  # values on the grid come back bit for bit
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(3))
    back = mxfp4.dequantize(*mxfp4.quantize(w), torch.float32)
    group_max = w.view(16, 4, 32).abs().amax(-1, keepdim=True)
    # The scale is < amax / 3 and e2m1's widest step (4 to 6) is twice it: round to nearest
    # errs by at most one scale.
    assert ((back - w).view(16, 4, 32).abs() <= group_max / 3 + 1e-7).all()
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4.quantize(torch.zeros(2, 40))


# The build for this CPU, and the narrower paths: AVX2 + FMA (required), plain C.
VARIANTS = {"native": None, "avx2": ["-mno-avx512f"], "plain-c": ["-mno-avx2", "-mno-fma"]}
EXPECTED_ISA = {"avx2": 1, "plain-c": 0}


@pytest.fixture(params=list(VARIANTS))
def lib(request):
    native = kernel.load()
    if native is None:
        pytest.skip("MXFP4 kernel not available here (no compiler or no libgomp)")
    if request.param == "native":
        return native
    flags = [*native_build.OPENMP_FLAGS, *VARIANTS[request.param]]
    stem = f"mxfp4_{request.param}"
    path = native_build.build(native_build.find_compiler(), kernel.KERNEL.source, stem, flags)
    variant = kernel.open_library(path)
    if variant.tw_mxfp4_isa() != EXPECTED_ISA[request.param]:
        pytest.skip(f"this CPU has no {request.param} path")
    return variant


@pytest.mark.parametrize("rows", [1, 2, 5, 8])
@pytest.mark.parametrize(("n", "k"), [(3, 32), (70, 96), (130, 2880)])
def test_kernel_matches_dequantize_and_matmul(lib, rows: int, n: int, k: int) -> None:
    blocks, scales = _random_weights(n, k, seed=rows + n)
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(rows, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    dense = mxfp4.dequantize(blocks, scales, torch.float64)
    bound = x.abs().double() @ dense.abs().T  # what reordering a float32 sum can cost
    for b in (None, bias):
        want = x.double() @ dense.T + (0 if b is None else b.double())
        got = kernel.mxfp4_gemv(lib, x, blocks, scales, b)
        assert ((got.double() - want).abs() <= 1e-6 * bound + 1e-6).all()
    scalar = kernel.mxfp4_gemv(lib, x, blocks, scales, bias, scalar=True)  # the plain C loop
    assert ((scalar.double() - want).abs() <= 1e-6 * bound + 1e-6).all()


def test_kernel_refuses_what_it_cannot_compute(lib) -> None:
    blocks, scales = _random_weights(4, 64, seed=0)
    with pytest.raises(ValueError, match="do not fit x of 32 columns"):
        kernel.mxfp4_gemv(lib, torch.zeros(1, 32), blocks, scales, None)
    with pytest.raises(ValueError, match="refused M=9"):
        kernel.mxfp4_gemv(lib, torch.zeros(9, 64), blocks, scales, None)


def test_linear_takes_the_kernel_for_few_rows_and_dequantizes_for_more() -> None:
    blocks, scales = _random_weights(40, 64, seed=4)
    gen = torch.Generator().manual_seed(5)
    bias = torch.randn(40, generator=gen)
    dense = mxfp4.dequantize(blocks, scales, torch.float32)
    for rows in (1, 8, 9, 33):
        x = torch.randn(rows, 64, generator=gen)
        got = mxfp4.mxfp4_linear(x, blocks, scales, bias)
        torch.testing.assert_close(got, x @ dense.T + bias, atol=1e-4, rtol=1e-5)
    x = torch.randn(3, 64, generator=gen).bfloat16()
    got = mxfp4.mxfp4_linear(x, blocks, scales, bias.bfloat16())
    assert got.dtype == torch.bfloat16
