"""The conversions and the polynomial exp of `tokenwise/native/common.h`, which every kernel
shares, against torch's: bf16 and fp8 bit for bit (the rounding torch does), fp16 -> float32
exactly, exp within a few ulps with its clamps. Through `common_entry.c`, built here with the
flags of the kernels that use them (and without F16C, for the software paths)."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from tokenwise.native import build
from tokenwise.native import fused as native_fused
from tokenwise.native import paged_decode as native_paged_decode

ENTRY = Path(__file__).with_name("common_entry.c")
FLAGS = {
    "fused": native_fused.FLAGS,  # no contraction, no fast math
    "paged_decode": native_paged_decode.CFLAGS,  # the fast-math parts
    "no-f16c": [*build.BASE_FLAGS, "-mno-f16c"],  # the software half and fp8 paths
}
FP8 = {"e4m3": (torch.float8_e4m3fn, 0), "e5m2": (torch.float8_e5m2, 1)}

pytestmark = pytest.mark.skipif(build.find_compiler() is None, reason="no C compiler")


@pytest.fixture(scope="module", params=list(FLAGS))
def lib(request, tmp_path_factory) -> ctypes.CDLL:
    out = tmp_path_factory.mktemp("common_h") / f"entry_{request.param}.so"
    command = [build.find_compiler(), *FLAGS[request.param], f"-I{build.NATIVE_DIR}"]
    subprocess.run(
        [*command, "-o", str(out), str(ENTRY), "-lm"], check=True, capture_output=True, timeout=120
    )
    lib = ctypes.CDLL(str(out))
    lib.flags = request.param
    return lib


def _run(fn, x: torch.Tensor, out_dtype: torch.dtype, *extra: int) -> torch.Tensor:
    x = x.contiguous()
    y = torch.empty(x.shape, dtype=out_dtype)
    fn(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(y.data_ptr()), ctypes.c_int64(x.numel()),
       *[ctypes.c_int(e) for e in extra])  # fmt: skip
    return y


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal bit for bit, except that any NaN matches any NaN."""
    nan = torch.isnan(want.float())
    assert torch.equal(torch.isnan(got.float()), nan)
    bits = {2: torch.int16, 4: torch.int32, 1: torch.uint8}[got.element_size()]
    assert torch.equal(got[~nan].view(bits), want[~nan].view(bits))


def _all_float32_kinds(count: int) -> torch.Tensor:
    """Random float32 bit patterns (every exponent: subnormals, NaN and infinities included),
    and values exactly halfway between two bf16 numbers (ties)."""
    g = np.random.default_rng(0)
    bits = g.integers(0, 2**32, count, dtype=np.uint64).astype(np.uint32)
    ties = (bits & 0xFFFF0000) | 0x8000
    return torch.from_numpy(np.concatenate([bits, ties]).view(np.float32))


def test_f32_to_bf16_rounds_as_torch(lib) -> None:
    x = _all_float32_kinds(200_000)
    _same_bits(_run(lib.t_f32_to_bf16, x, torch.bfloat16), x.to(torch.bfloat16))


def test_bf16_and_f16_widen_exactly(lib) -> None:
    codes = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    for dtype, fn in ((torch.bfloat16, lib.t_bf16_to_f32), (torch.float16, lib.t_f16_to_f32)):
        _same_bits(_run(fn, codes, torch.float32), codes.view(dtype).float())


@pytest.mark.parametrize("fmt", list(FP8))
def test_fp8_widens_every_finite_code_exactly(lib, fmt: str) -> None:
    dtype, e5m2 = FP8[fmt]
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    want = codes.view(dtype).float()
    finite = torch.isfinite(want)
    got = _run(lib.t_fp8_to_f32, codes, torch.float32, e5m2)
    assert torch.equal(got[finite], want[finite])
    # The vector widening (F16C: 8 and 16 bytes at a time) gives the same as the scalar one.
    wide = torch.empty(256, dtype=torch.float32)
    status = lib.t_fp8x16_to_f32(
        ctypes.c_void_p(codes.data_ptr()), ctypes.c_void_p(wide.data_ptr()), ctypes.c_int64(256),
        ctypes.c_int(e5m2),
    )  # fmt: skip
    assert status in (0, 1), "the 8- and 16-wide widenings disagree"
    if status == 1:
        assert torch.equal(wide[finite], want[finite])


@pytest.mark.parametrize("fmt", list(FP8))
def test_f32_to_fp8_rounds_as_torch_and_saturates(lib, fmt: str) -> None:
    dtype, e5m2 = FP8[fmt]
    limit, tiny = torch.finfo(dtype).max, torch.finfo(dtype).smallest_normal
    g = torch.Generator().manual_seed(1)
    # Values over the whole range, the subnormal range, and every midpoint between two codes.
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    codes = codes[torch.isfinite(codes)].sort().values
    x = torch.cat([
        (torch.rand(50_000, generator=g) * 2 - 1) * limit,
        (torch.rand(20_000, generator=g) * 2 - 1) * tiny * 2,
        (codes[1:] + codes[:-1]) / 2,
        torch.tensor([0.0, -0.0, limit, -limit]),
    ])  # fmt: skip
    got = _run(lib.t_f32_to_fp8, x, torch.uint8, e5m2)
    assert torch.equal(got, x.to(dtype).view(torch.uint8))
    # Past the finite range (and at infinity) the write saturates instead of overflowing.
    over = torch.tensor([limit * 4, -limit * 4, float("inf"), float("-inf")])
    back = _run(lib.t_f32_to_fp8, over, torch.uint8, e5m2).view(dtype).float()
    assert back.tolist() == [limit, -limit, limit, -limit]


def test_exp_within_a_few_ulps_with_its_clamps(lib) -> None:
    # paged_decode.c (fast-math flags, which may merge the two halves of 2^n) calls it on
    # scores minus their maximum only: x <= 0.
    top = 0.0 if lib.flags == "paged_decode" else 88.5
    g = torch.Generator().manual_seed(2)
    x = torch.cat([torch.linspace(-87.0, top, 100_001), (torch.rand(100_000, generator=g) - 0.5)])
    got = _run(lib.t_exp, x, torch.float32).double()
    want = torch.exp(x.double())
    assert float(((got - want).abs() / want).max()) < 1e-6  # about 8 float32 ulps
    low, at_low = _run(lib.t_exp, torch.tensor([-100.0, -87.0]), torch.float32).tolist()
    assert low == at_low > 0  # clamped at -87: tiny, not zero
    if lib.flags == "paged_decode":
        return
    edges = torch.tensor([88.7, 89.0, 100.0])
    high, inf1, inf2 = _run(lib.t_exp, edges, torch.float32).tolist()
    assert high == pytest.approx(float(torch.tensor(88.7).double().exp()), rel=1e-6)
    assert inf1 == inf2 == float("inf")  # overflows as expf does
