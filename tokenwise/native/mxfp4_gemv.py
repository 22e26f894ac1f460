"""The MXFP4 CPU linear kernel (`mxfp4_gemv.c`), loaded through ctypes.

`tw_mxfp4_gemv` multiplies up to 8 rows of float32 activations by MXFP4 weights kept in the
checkpoint's own bytes (gpt-oss's experts: `*_blocks` + `*_scales`), decoding each group of 32
in registers; `layers.quantization.mxfp4` calls it for decode-sized rows and dequantizes with
torch ops for more rows (prefill) or where it cannot be built. Built at first use for this CPU
by `native.build` (AVX-512 or AVX2 + FMA where the CPU has them, else plain C), used only where torch's
OpenMP runtime is libgomp, whose threads it then shares, as the other linear kernels.
"""

from __future__ import annotations

import ctypes
import logging
from functools import cache
from pathlib import Path

import torch

from tokenwise.native import build, trace

logger = logging.getLogger(__name__)

KERNEL = build.Kernel(
    "mxfp4_gemv.c",
    what="the MXFP4 CPU linear kernel",
    fallback="MXFP4 experts are dequantized with torch ops at every call",
    needs_libgomp=True,
)
MAX_ROWS = 8
ISA_NAMES = {0: "plain C", 1: "AVX2+FMA", 2: "AVX-512"}

_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


@cache
def load() -> ctypes.CDLL | None:
    """The compiled kernel, or None where it cannot be built or used."""
    lib = KERNEL.load(build.OPENMP_FLAGS, open_library)
    if lib is not None:
        logger.info("MXFP4 CPU linear kernel built for %s", ISA_NAMES.get(lib.tw_mxfp4_isa()))
    return lib


def open_library(path: Path) -> ctypes.CDLL:
    """The built kernel at `path`, its functions typed."""
    lib = ctypes.CDLL(str(path))
    lib.tw_mxfp4_isa.restype = ctypes.c_int
    lib.tw_mxfp4_gemv.restype = ctypes.c_int
    lib.tw_mxfp4_gemv.argtypes = [_PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64]
    lib.tw_mxfp4_gemv_scalar.restype = ctypes.c_int
    lib.tw_mxfp4_gemv_scalar.argtypes = [_PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64]
    lib.tw_mxfp4_gemv_packed.restype, lib.tw_mxfp4_gemv_packed.argtypes = ctypes.c_int, [_PTR]
    return lib


def mxfp4_gemv(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    blocks: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    scalar: bool = False,
) -> torch.Tensor:
    """`x @ dequant(blocks, scales)^T + bias` for float32 `x [M, K]`, M <= `MAX_ROWS`;
    `blocks` uint8 `[N, K / 32, 16]`, `scales` uint8 `[N, K / 32]`, bias float32 `[N]`; all
    contiguous CPU tensors. `scalar=True` runs the plain C definition (tests)."""
    m, k = x.shape
    n = blocks.shape[0]
    if tuple(blocks.shape) != (n, k // 32, 16) or tuple(scales.shape) != (n, k // 32):
        raise ValueError(
            f"MXFP4 weights {tuple(blocks.shape)} / scales {tuple(scales.shape)} do not fit "
            f"x of {k} columns (expected [N, {k // 32}, 16] / [N, {k // 32}])"
        )
    if not x.is_contiguous():
        x = x.contiguous()
    out = torch.empty(m, n, dtype=torch.float32)
    ptrs = trace.ptrs(x, blocks, scales, bias, out)
    if scalar:
        status = lib.tw_mxfp4_gemv_scalar(*ptrs, m, n, k)
    else:
        status = trace.call(lib, "tw_mxfp4_gemv", *ptrs, m, n, k, torch.get_num_threads())
    if status != 0:
        raise ValueError(f"MXFP4 kernel refused M={m}, N={n}, K={k} (status {status})")
    return out
