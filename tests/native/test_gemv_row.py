"""The one-row path of `native/gemv.c` (`gemv_row.h`: one weight row after another, float32 or
bf16) built for haswell (AVX2 + FMA) agrees with the build for this CPU, and gives the same bits
whatever the thread count: each output is one row's dot product, summed in one fixed order."""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from tests.native.test_gemv_march import cache, libs  # noqa: F401  (module-scoped fixtures)
from tokenwise.native import gemv as cpu_gemv

# K: below one AVX2 vector, one vector and a tail, whole blocks of 4 vectors (AVX2: 32 values,
# AVX-512: 64), blocks then single vectors then a tail. N=131 splits over threads unevenly;
# N=20 stays on the calling thread (the kernel's parallel minimum is 32 rows).
SHAPES = [(131, 5), (131, 13), (131, 768), (131, 1031), (20, 1031)]


def _call(lib: ctypes.CDLL, x, weight, bias, threads: int) -> torch.Tensor:
    n, k = weight.shape
    out = torch.empty(1, n)
    status = lib.tw_gemv(
        x.data_ptr(),
        weight.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        1,
        n,
        k,
        0,
        threads,
    )
    assert status == 0
    return out


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_row_haswell_agrees_with_native_and_f64(
    libs,  # noqa: F811
    n: int,
    k: int,
    with_bias: bool,
    dtype: torch.dtype,
) -> None:
    haswell, native = libs
    gen = torch.Generator().manual_seed(n * 10_000 + k)
    weight = torch.randn(n, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    x = torch.randn(1, k, generator=gen).to(dtype)
    exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    # float32 sums in some order: within 1e-5 of |x| @ |W| (plus the bias's own rounding);
    # bf16 results then rounded once more (half a bf16 unit: 2^-9 relative, 2^-8 to be safe).
    bound = 1e-5 * (x.abs().double() @ weight.abs().double().T + 1.0)
    if dtype == torch.bfloat16:
        bound = bound + exact.abs() * 2.0**-8
    a = cpu_gemv.linear(haswell, x, weight, bias)
    b = cpu_gemv.linear(native, x, weight, bias)
    assert a.shape == b.shape == (1, n)
    assert ((a.double() - exact).abs() <= bound).all()
    assert ((b.double() - exact).abs() <= bound).all()
    assert ((a.double() - b.double()).abs() <= 2 * bound).all()


def test_one_row_is_bitwise_the_same_on_one_thread_and_two(libs) -> None:  # noqa: F811
    """The rows are split between threads, never a row's sum: the thread count changes no bit."""
    for lib in libs:
        gen = torch.Generator().manual_seed(7)
        weight, x, bias = torch.randn(515, 1031, generator=gen), torch.randn(1, 1031), None
        one = _call(lib, x, weight, bias, 1)
        two = _call(lib, x, weight, bias, 2)
        assert torch.equal(one, two)
        torch.testing.assert_close(one, F.linear(x, weight), rtol=1e-4, atol=1e-4)
