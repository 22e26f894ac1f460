"""The C kernels of FP8 linear layers on CPU (`fp8_gemv.c`), loaded through ctypes.

`tw_fp8_gemv` multiplies up to 8 rows of activations by float8_e4m3fn weights, widening them
in registers (an e4m3 byte's bits moved into an IEEE half, then F16C), each tile's, row's or
the tensor's scale applied on the way: decode reads 1 byte per weight instead of bf16's 2.
Activations stay in floating point (weight-only, as on CPU for every quantized format).
`tw_fp8_dequant` writes the dense weight for larger row counts (prefill), which then run through
torch's matmul. torch's own CPU routes are far slower (`benchmarks/fp8_linear.py`: its fp8 ->
bf16 conversion and its CPU `_scaled_mm` take 50-100x a bf16 layer's time at one row).

Built at first use for this CPU by `native.build`, like `qgemv`, used under the same
conditions (libgomp, so it runs on torch's OpenMP threads, and a vector ISA: AVX2 + F16C or
AVX-512), for layers whose input size is a multiple of 16 and whose tiles are multiples of 16
columns and 4 rows. Elsewhere `FP8Weight` dequantizes with torch ops: slower, same values.
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
    "fp8_gemv.c",
    what="the fp8 CPU linear kernel",
    fallback="fp8 layers dequantize with torch ops",
    needs_libgomp=True,
)
MAX_ROWS = 8
ISA_NAMES = {0: "plain C", 1: "AVX2 + F16C", 2: "AVX-512"}
KINDS = {"tensor": 0, "channel": 1, "block": 2}

_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p
_INT = ctypes.c_int


@cache
def load() -> ctypes.CDLL | None:
    """The compiled kernels, or None where they cannot be built, would not share torch's
    OpenMP threads, or have no vector path on this CPU."""
    lib = KERNEL.load(build.OPENMP_FLAGS, open_library)
    if lib is None:
        return None
    if lib.tw_fp8_isa() == 0:
        logger.info("fp8 CPU linear kernel not used: no AVX2 + F16C or AVX-512 on this CPU")
        return None
    logger.info("fp8 CPU linear kernel built for %s", ISA_NAMES[lib.tw_fp8_isa()])
    return lib


def open_library(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.tw_fp8_isa.restype = _INT
    lib.tw_fp8_gemv.restype = _INT
    lib.tw_fp8_gemv.argtypes = [_PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _INT]
    lib.tw_fp8_gemv.argtypes += [_I64, _I64, _INT, _INT]
    lib.tw_fp8_gemv_packed.restype, lib.tw_fp8_gemv_packed.argtypes = _INT, [_PTR]
    lib.tw_fp8_dequant.restype = _INT
    lib.tw_fp8_dequant.argtypes = [_PTR, _PTR, _PTR, _I64, _I64, _INT, _I64, _I64, _INT, _INT]
    return lib


def fits(shape: tuple[int, int], block: tuple[int, int] | None) -> bool:
    """Whether the kernels take a weight of this shape and tiling."""
    if shape[1] % 16:
        return False
    return block is None or (block[0] % 4 == 0 and block[1] % 16 == 0)


def _layout(kind: str, block: tuple[int, int] | None) -> tuple[int, int, int]:
    bn, bk = block if block is not None else (1, 1)
    return KINDS[kind], bn, bk


def gemv(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    kind: str,
    block: tuple[int, int] | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """`x @ dequant(weight)^T + bias` for x (float32 or bf16) of at most `MAX_ROWS` rows."""
    n, k = weight.shape
    rows = x.numel() // k
    x2 = x.reshape(rows, k).contiguous()
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype)
    if bias is not None:
        bias = bias.to(x.dtype).contiguous()
    status = trace.call(
        lib,
        "tw_fp8_gemv",
        *trace.ptrs(x2, weight, scale, bias, out),
        rows,
        n,
        k,
        *_layout(kind, block),
        int(x.dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    if status != 0:
        raise RuntimeError(f"fp8 CPU kernel failed (status {status}) for {rows}x{k} @ {n}x{k}")
    return out


# Per dtype, one buffer the dense weight of a prefill-sized call is written into and read from
# at once: a fresh tensor per call would fault in its pages on every call, which took ~13x the
# dequantization itself (4.9 ms against 0.37 for a 4096x768 layer). Grown to the largest layer.
_SCRATCH: dict[torch.dtype, torch.Tensor] = {}


def scratch(n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """A reused `[n, k]` tensor of `dtype`, valid until the next call (one forward at a time)."""
    buffer = _SCRATCH.get(dtype)
    if buffer is None or buffer.numel() < n * k:
        buffer = _SCRATCH[dtype] = torch.empty(n * k, dtype=dtype)
    return buffer[: n * k].view(n, k)


def dequantize(
    lib: ctypes.CDLL,
    weight: torch.Tensor,
    scale: torch.Tensor,
    kind: str,
    block: tuple[int, int] | None,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The dense `[N, K]` weight in float32 or bf16 (written into `out` when given)."""
    n, k = weight.shape
    out = torch.empty(n, k, dtype=dtype) if out is None else out
    status = lib.tw_fp8_dequant(
        weight.data_ptr(),
        scale.data_ptr(),
        out.data_ptr(),
        n,
        k,
        *_layout(kind, block),
        int(dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    if status != 0:
        raise RuntimeError(f"fp8 CPU dequantize failed (status {status}) for {n}x{k}")
    return out
