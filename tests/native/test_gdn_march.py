"""The gated delta-rule decode kernel over a bf16 state (`native/gdn_decode.c`), built for this
CPU and for haswell (AVX2 + FMA, `TOKENWISE_CPU_MARCH=haswell`): its vectorised bf16 <-> float32
conversion must give exactly the float32 kernel's result rounded by torch (to nearest even,
denormals kept), vector tails included, on either instruction set."""

from __future__ import annotations

import pytest
import torch

from tokenwise.native import build as native_build
from tokenwise.native import gdn_decode


def _build(march: str, cache, monkeypatch: pytest.MonkeyPatch):
    compiler = native_build.find_compiler()
    monkeypatch.setenv("TOKENWISE_KERNEL_CACHE", str(cache))
    monkeypatch.setenv("TOKENWISE_CPU_MARCH", march)
    path = native_build.build(compiler, gdn_decode.KERNEL.source, "gdn_decode", gdn_decode._flags())
    return gdn_decode.open_library(path)


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    if native_build.find_compiler() is None:
        pytest.skip("no C compiler")
    flags = native_build.cpu_flags().split()
    if "avx2" not in flags or "fma" not in flags:
        pytest.skip("this CPU cannot run the haswell build")
    cache = tmp_path_factory.mktemp("kernels")
    with pytest.MonkeyPatch.context() as mp:
        return {march: _build(march, cache, mp) for march in ("haswell", "native")}


def _call(lib, states, slots, q, k, v, g, beta, heads):
    nk, nv, dk, dv = heads
    out = torch.empty(len(slots), nv, dv)
    kernel = lib.gdn_decode if states.dtype == torch.float32 else lib.gdn_decode_bf16
    args = (q, k, v, g, beta, out)
    status = kernel(
        states.data_ptr(), states.shape[1], 0, slots.data_ptr(), len(slots),
        *(t.data_ptr() for t in args), nk, nv, dk, dv,
    )  # fmt: skip
    assert status == 0
    return out


@pytest.mark.parametrize("march", ["haswell", "native"])
@pytest.mark.parametrize("dv", [32, 20])  # 20: a vector tail on AVX2 and AVX-512
def test_bf16_state_is_the_float32_step_rounded_by_torch(libs, march: str, dv: int) -> None:
    lib = libs[march]
    nk, nv, dk = 1, 2, 8
    gen = torch.Generator().manual_seed(5)
    states = torch.randn(3, nv * dk * dv, generator=gen).to(torch.bfloat16)
    states[0, :40] = 3e-39  # denormal in bf16 and float32: kept, not flushed
    slots = torch.tensor([0, 2])
    q, k = torch.randn(2, nk, dk, generator=gen), torch.randn(2, nk, dk, generator=gen)
    k[0, 0, :2] = 0.0  # rows of the head that only decay
    v, beta = torch.randn(2, nv, dv, generator=gen), torch.rand(2, nv, generator=gen)
    g = torch.tensor([[0.0, -0.5], [-1e-3, -2.0]])
    wide = states.float()
    want_out = _call(lib, wide, slots, q, k, v, g, beta, (nk, nv, dk, dv))
    got_out = _call(lib, states, slots, q, k, v, g, beta, (nk, nv, dk, dv))
    torch.testing.assert_close(got_out, want_out)
    want = wide.to(torch.bfloat16)
    assert torch.equal(states.view(torch.int16), want.view(torch.int16))  # bit for bit
    assert (states[0, :40].float().abs() > 0).sum() > 0  # denormals survived somewhere
