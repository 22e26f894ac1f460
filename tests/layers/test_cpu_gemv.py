"""The small-M C linear kernel (`tokenwise.native.gemv`) against F.linear, and the
CPU linear path's choice between it and the prepacked / F.linear paths."""

from __future__ import annotations

import logging
import subprocess

import pytest
import torch
import torch.nn.functional as F

from tokenwise.layers import cpu_prepack
from tokenwise.native import build as native_build
from tokenwise.native import gemv as cpu_gemv

# Odd sizes: neither a multiple of the vector width (8/16 floats, 32 bf16) nor of the block
# of 4 weight rows; N=37 stays on one thread (below the kernel's parallel minimum), the others
# split over threads.
SHAPES = [(37, 45), (130, 1031), (1, 7), (515, 64)]
# Every direct-path row count, then the blocked path's: whole tiles of x (4 with AVX2, 6 with
# AVX-512) and each remainder, up to the kernel's limit.
ROWS = [*range(1, 10), 13, 23, cpu_gemv.KERNEL_MAX_ROWS]


# The build for this CPU, and the narrower paths a CPU with fewer vector extensions gets:
# AVX-512 without AVX512_BF16 (bf16 widened in registers), and AVX2 + FMA.
VARIANTS = {"native": [], "avx512": ["-mno-avx512bf16"], "avx2": ["-mno-avx512f"]}
EXPECTED_ISA = {"avx512": 2, "avx2": 1}


@pytest.fixture
def lib():
    lib = cpu_gemv.load()
    if lib is None:
        pytest.skip("small-M kernel not available here (no compiler, no AVX2, or no libgomp)")
    return lib


@pytest.fixture(params=list(VARIANTS))
def any_lib(request, lib):
    """The kernel built for this CPU, and for the narrower vector paths it also supports."""
    if request.param == "native":
        return lib
    flags = [*cpu_gemv._flags(), *VARIANTS[request.param]]
    variant = cpu_gemv.open_library(
        native_build.build(native_build.find_compiler(), cpu_gemv.KERNEL.source, "gemv", flags)
    )
    if variant.tw_gemv_isa() != EXPECTED_ISA[request.param]:
        pytest.skip(f"this CPU has no {request.param} path")
    return variant


def _abs_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """|x| @ |W|^T: scales the rounding error any order of summation can make."""
    return x.abs().double() @ weight.abs().double().T


def _bf16_ulp(values: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of bf16 (8 significant bits) at each value."""
    exponent = torch.floor(torch.log2(values.abs().double().clamp_min(2.0**-126)))
    return torch.exp2(exponent - 7)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_float32_matches_f_linear(any_lib, rows: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=gen)
    weight = torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    for b in (None, bias):
        out = cpu_gemv.linear(any_lib, x, weight, b)
        ref = F.linear(x.double(), weight.double(), None if b is None else b.double())
        bound = 1e-5 * (_abs_bound(x, weight) + (0 if b is None else b.abs().double()))
        assert out.dtype == torch.float32 and out.shape == (rows, n)
        assert ((out.double() - ref).abs() <= bound).all()
        torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-5, atol=1e-5 * k**0.5)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_bfloat16_is_the_fp32_accumulated_result_rounded(
    any_lib, rows: int, n: int, k: int
) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    weight = torch.randn(n, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    for b in (None, bias):
        out = cpu_gemv.linear(any_lib, x, weight, b)
        exact = x.double() @ weight.double().T + (0 if b is None else b.double())
        ref = exact.float().bfloat16()
        assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
        # Within one bf16 ulp, or within what fp32 reassociation can move a cancelled sum.
        slack = torch.maximum(_bf16_ulp(ref), 1e-6 * _abs_bound(x, weight))
        assert ((out.double() - ref.double()).abs() <= slack).all()


def test_keeps_leading_dims_and_non_contiguous_input(lib) -> None:
    weight = torch.randn(33, 40)
    x = torch.randn(40, 3).T.reshape(1, 3, 40)  # reshape of a transposed view copies here
    x_view = torch.randn(3, 80)[:, ::2]  # a strided view
    for inp in (x, x_view):
        out = cpu_gemv.linear(lib, inp, weight, None)
        assert out.shape == (*inp.shape[:-1], 33)
        torch.testing.assert_close(out, F.linear(inp, weight), rtol=1e-5, atol=1e-5)


def test_linear_routes_decode_sized_calls_to_the_kernel(lib, monkeypatch) -> None:
    calls: list[int] = []
    original = cpu_gemv.linear

    def spy(lib, x, weight, bias):
        calls.append(x.numel() // x.shape[-1])
        return original(lib, x, weight, bias)

    monkeypatch.setattr(cpu_gemv, "linear", spy)
    weight = torch.randn(64, 48)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight)
    with torch.inference_mode():
        limit = cpu_gemv.max_rows(torch.float32)
        for rows in (1, limit, limit + 1):
            x = torch.randn(rows, 48)
            out = cpu_prepack.linear(x, weight, None, packed)
            torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-5, atol=1e-5)
        cpu_prepack.linear(torch.randn(0, 48), weight, None, packed)  # empty: not the kernel
    assert calls == [1, limit]


def test_autograd_inputs_keep_the_torch_path(lib, monkeypatch) -> None:
    monkeypatch.setattr(cpu_gemv, "linear", lambda *a: pytest.fail("kernel has no backward"))
    weight = torch.randn(16, 8, requires_grad=True)
    out = cpu_prepack.linear(torch.randn(1, 8), weight, None, None)
    assert out.requires_grad


def test_switched_off_by_environment(monkeypatch) -> None:
    monkeypatch.setenv("TOKENWISE_CPU_GEMV", "0")
    cpu_gemv.load.cache_clear()
    try:
        assert cpu_gemv.load() is None
        weight, x = torch.randn(20, 12), torch.randn(2, 12)
        torch.testing.assert_close(cpu_prepack.linear(x, weight, None, None), F.linear(x, weight))
    finally:
        monkeypatch.undo()
        cpu_gemv.load.cache_clear()


def test_build_failure_falls_back_with_a_warning(monkeypatch, caplog) -> None:
    def failing_build(*args, **kwargs):
        raise subprocess.CalledProcessError(1, "cc", stderr="error: no such instruction")

    monkeypatch.setattr(native_build, "build", failing_build)
    monkeypatch.setattr(native_build, "torch_uses_libgomp", lambda: True)
    cpu_gemv.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="tokenwise.native.build"):
            assert cpu_gemv.load() is None
            weight, x = torch.randn(20, 12), torch.randn(1, 12)
            out = cpu_prepack.linear(x, weight, None, None)
        torch.testing.assert_close(out, F.linear(x, weight))
        assert "small-M CPU linear kernel failed to build" in caplog.text
        assert "no such instruction" in caplog.text
    finally:
        monkeypatch.undo()
        cpu_gemv.load.cache_clear()


def test_no_compiler_falls_back_with_a_warning(monkeypatch, caplog) -> None:
    monkeypatch.setattr(native_build, "find_compiler", lambda: None)
    monkeypatch.setattr(native_build, "torch_uses_libgomp", lambda: True)
    cpu_gemv.load.cache_clear()
    native_build._warn_no_compiler.cache_clear()  # said once per process
    try:
        with caplog.at_level(logging.WARNING, logger="tokenwise.native.build"):
            assert cpu_gemv.load() is None
        assert "no C compiler" in caplog.text
    finally:
        monkeypatch.undo()
        cpu_gemv.load.cache_clear()
