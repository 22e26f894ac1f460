"""The blocked small-M linear path (`native/gemv.c`, more rows than the direct path takes) built
for haswell (AVX2 + FMA, `TOKENWISE_CPU_MARCH=haswell`) agrees with the build for this CPU:
AVX2-only machines run the very code measured here under emulation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenwise.native import build as native_build
from tokenwise.native import gemv as cpu_gemv

# 3: the first AVX2 blocked row count; 13: three AVX2 tiles of 4 and one row (two AVX-512
# tiles of 6 and one); 48: the benchmarks' batch. N=131 leaves one weight row over a block
# of 3 (and of 4); K=1031 is no multiple of 8 or 16 (vector tails).
ROWS = (3, 13, 48)
N, K = 131, 1031


def _build(march: str, cache, monkeypatch: pytest.MonkeyPatch):
    """The kernel built for `march` into the test's own kernel cache."""
    compiler = native_build.find_compiler()
    if compiler is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("TOKENWISE_KERNEL_CACHE", str(cache))
    monkeypatch.setenv("TOKENWISE_CPU_MARCH", march)
    path = native_build.build(compiler, cpu_gemv.KERNEL.source, "gemv", cpu_gemv._flags())
    assert path.parent == cache
    return cpu_gemv.open_library(path)


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    if "avx2" not in native_build.cpu_flags().split() or "fma" not in native_build.cpu_flags():
        pytest.skip("this CPU cannot run the haswell build")
    if not native_build.torch_uses_libgomp():
        pytest.skip("the kernel is built against torch's libgomp")
    cache = tmp_path_factory.mktemp("kernels")
    with pytest.MonkeyPatch.context() as mp:
        haswell = _build("haswell", cache, mp)
        native = _build("native", cache, mp)
    assert haswell.tw_gemv_isa() == 1  # AVX2 + FMA, whatever this CPU has beyond it
    return haswell, native


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_haswell_build_agrees_with_native_build(libs, dtype: torch.dtype) -> None:
    haswell, native = libs
    gen = torch.Generator().manual_seed(51)
    weight = torch.randn(N, K, generator=gen).to(dtype)
    bias = torch.randn(N, generator=gen).to(dtype)
    for rows in ROWS:
        x = torch.randn(rows, K, generator=gen).to(dtype)
        a = cpu_gemv.linear(haswell, x, weight, bias)
        b = cpu_gemv.linear(native, x, weight, bias)
        exact = F.linear(x.double(), weight.double(), bias.double())
        # Sums in another order: float32 rounding of |x| @ |W|, then one bf16 rounding each.
        bound = 1e-5 * (x.abs().double() @ weight.abs().double().T)
        if dtype == torch.bfloat16:
            bound = bound + exact.abs() * 2.0**-8
        assert a.shape == b.shape == (rows, N)
        assert ((a.double() - exact).abs() <= bound).all(), rows
        assert ((a.double() - b.double()).abs() <= 2 * bound).all(), rows


def test_haswell_build_takes_any_row_count_and_rejects_none(libs) -> None:
    haswell, _ = libs
    weight, x = torch.randn(8, 16), torch.randn(70, 16)  # 70: more than the routed limits
    torch.testing.assert_close(cpu_gemv.linear(haswell, x, weight, None), F.linear(x, weight))
    with pytest.raises(RuntimeError, match="status -1"):
        cpu_gemv.linear(haswell, torch.randn(0, 16), weight, None)
