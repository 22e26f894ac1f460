"""The C kernels of group-quantized linear layers on CPU (`cpu_qgemv.c`), loaded through ctypes.

`tw_qgemv` multiplies up to 8 rows of activations by int8 or int4 weights, widening each group
in registers (decode: bound by reading the weights, so fewer bytes per weight is faster);
`tw_qdequant` writes the dense weights for larger row counts (prefill), which then run through
torch's matmul. Built at first use for this CPU by `native_build`, like `cpu_gemv`, and used
under the same conditions (libgomp, so the kernel runs on torch's OpenMP threads). Where it is
unavailable, `weight_only` dequantizes with torch ops instead: slower, same values.
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
from functools import cache
from pathlib import Path

import torch

from tokenwise.layers import native_build

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent.parent / "cpu_qgemv.c"
MAX_ROWS = 8
ISA_NAMES = {0: "plain C", 1: "AVX2", 2: "AVX-512"}

_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p
_INT = ctypes.c_int


@cache
def load() -> ctypes.CDLL | None:
    """The compiled kernels, or None where they cannot be built or would not share torch's
    OpenMP threads (the caller then dequantizes with torch ops)."""
    if not native_build.torch_uses_libgomp():
        logger.info("quantized CPU linear kernel not used: torch's OpenMP runtime is not libgomp")
        return None
    compiler = native_build.find_compiler()
    if compiler is None:
        logger.warning("no C compiler found: quantized layers dequantize with torch ops")
        return None
    flags = [*native_build.BASE_FLAGS, "-fopenmp"]
    try:
        lib = ctypes.CDLL(str(native_build.build(compiler, SOURCE, "qgemv", flags)))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        logger.warning("quantized CPU linear kernel build failed, using torch ops: %s", detail)
        return None
    lib.tw_qgemv_isa.restype = _INT
    lib.tw_qgemv.restype = _INT
    lib.tw_qgemv.argtypes = [_PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _INT, _I64]
    lib.tw_qgemv.argtypes += [_INT, _INT, _INT]
    lib.tw_qdequant.restype = _INT
    lib.tw_qdequant.argtypes = [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _INT, _I64, _INT, _INT, _INT]
    logger.info("quantized CPU linear kernel built for %s", ISA_NAMES.get(lib.tw_qgemv_isa()))
    return lib


def _ptr(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def qgemv(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    bias: torch.Tensor | None,
    bits: int,
    group_size: int,
    out_features: int,
) -> torch.Tensor:
    """`x @ dequant(W)^T + bias` for x of at most `MAX_ROWS` rows (over its last dim), x float32
    or bfloat16 (bias of x's dtype); all tensors contiguous CPU tensors."""
    k = x.shape[-1]
    rows = x.numel() // k
    x2 = x.reshape(rows, k)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    out = torch.empty((*x.shape[:-1], out_features), dtype=x.dtype)
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    status = lib.tw_qgemv(
        x2.data_ptr(),
        qweight.data_ptr(),
        scales.data_ptr(),
        _ptr(offsets),
        _ptr(bias),
        out.data_ptr(),
        rows,
        out_features,
        k,
        bits,
        group_size,
        int(scales.dtype == torch.float32),
        int(x.dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    if status != 0:
        raise RuntimeError(
            f"quantized CPU linear kernel failed (status {status}) for {rows}x{k} @ "
            f"int{bits}[{out_features}x{k}], group size {group_size}"
        )
    return out


def dequantize(
    lib: ctypes.CDLL,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    bits: int,
    group_size: int,
    shape: tuple[int, int],
    dtype: torch.dtype,
) -> torch.Tensor:
    """The dense `[N, K]` weight in `dtype` (float32 or bfloat16)."""
    out = torch.empty(shape, dtype=dtype)
    status = lib.tw_qdequant(
        qweight.data_ptr(),
        scales.data_ptr(),
        _ptr(offsets),
        out.data_ptr(),
        shape[0],
        shape[1],
        bits,
        group_size,
        int(scales.dtype == torch.float32),
        int(dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    if status != 0:
        raise RuntimeError(f"dequantizing int{bits}{list(shape)} failed (status {status})")
    return out
