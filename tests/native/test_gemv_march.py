"""The blocked small-M linear path (`native/gemv.c`, more rows than the direct path takes) built
for haswell (AVX2 + FMA, `TOKENWISE_CPU_MARCH=haswell`) agrees with the build for this CPU:
AVX2-only machines run the very code measured here under emulation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenwise.layers import cpu_prepack
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
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("kernels")


@pytest.fixture(scope="module")
def libs(cache):
    if "avx2" not in native_build.cpu_flags().split() or "fma" not in native_build.cpu_flags():
        pytest.skip("this CPU cannot run the haswell build")
    if not native_build.torch_uses_libgomp():
        pytest.skip("the kernel is built against torch's libgomp")
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


def test_an_avx2_build_routes_up_to_its_own_row_limits(libs, cache, monkeypatch) -> None:
    """On AVX2 the engine sends the kernel more rows than on AVX-512 (the blocked path wins
    there up to `MAX_ROWS_BY_ISA[1]`), and the prepacked path the rest."""
    monkeypatch.setenv("TOKENWISE_KERNEL_CACHE", str(cache))
    monkeypatch.setenv("TOKENWISE_CPU_MARCH", "haswell")
    calls: list[int] = []
    original = cpu_gemv.linear

    def spy(lib, x, weight, bias):
        calls.append(x.shape[0])
        return original(lib, x, weight, bias)

    monkeypatch.setattr(cpu_gemv, "linear", spy)
    cpu_gemv.load.cache_clear()
    try:
        limit = cpu_gemv.max_rows(torch.float32)
        assert (
            limit == cpu_gemv.MAX_ROWS_BY_ISA[1][torch.float32] > cpu_gemv.MAX_ROWS[torch.float32]
        )
        assert cpu_gemv.max_rows(torch.bfloat16) == cpu_gemv.MAX_ROWS_BY_ISA[1][torch.bfloat16]
        weight = torch.randn(40, 24)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        with torch.inference_mode():
            for rows in (limit, limit + 1):
                x = torch.randn(rows, 24)
                out = cpu_prepack.linear(x, weight, None, packed)
                torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-5, atol=1e-5)
        assert calls == [limit]
    finally:
        monkeypatch.undo()
        cpu_gemv.load.cache_clear()
