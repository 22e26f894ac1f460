"""The C kernels of group-quantized linear layers on CPU (`qgemv.c`), loaded through ctypes.

`tw_qgemv` multiplies up to 64 rows of activations by int8 or int4 weights, widening each group
in registers (decode: bound by reading the weights, so fewer bytes per weight is faster; above
8 rows, tiles of rows share each block of weights read once: decode batches of 8-64 sequences).
bfloat16 activations run on integers: by default quantized to int8 per 32 values, llama.cpp's
arithmetic for its Q8_0 / Q4_0 dot products (`TOKENWISE_CPU_QUANT_ACTIVATIONS=int16` keeps 16
bits instead: 1/65534 of a group's largest value rather than 1/254, and 1.3-1.8x slower on
AVX512_VNNI); float32 activations take the exact float path unless
`TOKENWISE_CPU_QUANT_FP32_ACTIVATIONS=int8` asks for llama.cpp's int8 arithmetic (on AVX2
without VNNI the float path widens every weight to float32, 3-4 instructions per 8 weights, and
is bound by that work rather than by memory: the int8 path is 2.6-3.4x faster at one row);
`tw_qdequant` writes the dense weights for larger row counts (prefill), which then run through
torch's matmul. Built at first use for this CPU by `native.build`, like `gemv`, and used
under the same conditions (libgomp, so the kernel runs on torch's OpenMP threads). Where it is
unavailable, `weight_only` dequantizes with torch ops instead: slower, same values.
"""

from __future__ import annotations

import ctypes
import logging
from functools import cache
from pathlib import Path

import torch

from tokenwise import envs
from tokenwise.native import build, trace

logger = logging.getLogger(__name__)

KERNEL = build.Kernel(
    "qgemv.c",
    what="the quantized CPU linear kernel",
    fallback="layers dequantize with torch ops",
    needs_libgomp=True,
)
# Rows the kernel multiplies together in registers; one call takes up to KERNEL_MAX_ROWS, in
# tiles of rows that each read a block of weights from the cache (`run_tiles` in qgemv.c).
MAX_ROWS = 8
KERNEL_MAX_ROWS = 64
ISA_NAMES = {0: "plain C", 1: "AVX2", 2: "AVX-512"}
ACTIVATIONS_ENV = "TOKENWISE_CPU_QUANT_ACTIVATIONS"
ACTIVATION_BITS = {"int8": 8, "int16": 16}
FP32_ACTIVATIONS_ENV = "TOKENWISE_CPU_QUANT_FP32_ACTIVATIONS"
# "auto": int8 for layers holding a GGUF file's blocks (llama.cpp's own arithmetic for them),
# the exact float path for every other layer.
FP32_ACTIVATION_BITS: dict[str, int | None] = {"auto": None, "float": 32, "int8": 8}

_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p
_INT = ctypes.c_int


@cache
def load() -> ctypes.CDLL | None:
    """The compiled kernels, or None where they cannot be built or would not share torch's
    OpenMP threads (the caller then dequantizes with torch ops)."""
    lib = KERNEL.load(flags(), open_library)
    if lib is None:
        return None
    logger.info("quantized CPU linear kernel built for %s", ISA_NAMES.get(lib.tw_qgemv_isa()))
    return lib


def flags() -> list[str]:
    return build.OPENMP_FLAGS


def open_library(path: Path) -> ctypes.CDLL:
    """The built kernels at `path`, their functions typed."""
    lib = ctypes.CDLL(str(path))
    lib.tw_qgemv_isa.restype = _INT
    lib.tw_qgemv.restype = _INT
    lib.tw_qgemv.argtypes = [_PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _INT, _I64]
    lib.tw_qgemv.argtypes += [_INT, _INT, _INT, _INT]
    lib.tw_qdequant.restype = _INT
    lib.tw_qdequant.argtypes = [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _INT, _I64, _INT, _INT, _INT]
    lib.tw_qrows.restype = _INT
    lib.tw_qrows.argtypes = [_PTR, _PTR, _PTR, _PTR, _I64, _PTR, _I64, _INT, _I64, _INT, _INT]
    for name in ("tw_qgemv", "tw_qrows"):  # what a replayed CPU graph calls (`trace`)
        packed = getattr(lib, name + "_packed")
        packed.restype, packed.argtypes = _INT, [_PTR]
    return lib


@cache
def activation_bits() -> int:
    """The bits bfloat16 activations are quantized to (`TOKENWISE_CPU_QUANT_ACTIVATIONS`)."""
    name = envs.get(ACTIVATIONS_ENV).strip().lower()
    if name not in ACTIVATION_BITS:
        raise ValueError(
            f"{ACTIVATIONS_ENV} must be one of {', '.join(ACTIVATION_BITS)}, got {name!r}"
        )
    return ACTIVATION_BITS[name]


@cache
def fp32_activation_bits() -> int | None:
    """What float32 activations become (`TOKENWISE_CPU_QUANT_FP32_ACTIVATIONS`): 32, the exact
    float path, 8, int8 per 32 values, or None (auto: the layer's kind decides, `default_x_bits`)."""
    name = envs.get(FP32_ACTIVATIONS_ENV).strip().lower()
    if name not in FP32_ACTIVATION_BITS:
        raise ValueError(
            f"{FP32_ACTIVATIONS_ENV} must be one of {', '.join(FP32_ACTIVATION_BITS)}, got {name!r}"
        )
    return FP32_ACTIVATION_BITS[name]


def default_x_bits(dtype: torch.dtype, gguf_file: bool = False) -> int:
    """The activation bits the settings ask for x of `dtype` before a layer whose blocks came
    from a GGUF file (`gguf_file`) or not. float32 x under "auto" is int8 for GGUF blocks:
    llama.cpp multiplies Q8_0 / Q4_0 blocks by int8 activations, so a GGUF user gets the
    arithmetic (and, on AVX2 without VNNI, the 2-4x faster decode GEMV) the file was made for;
    layers tokenwise quantized itself keep the exact product."""
    if dtype == torch.bfloat16:
        return activation_bits()
    bits = fp32_activation_bits()
    if bits is None:
        return 8 if gguf_file else 32
    return bits


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
    x_bits: int | None = None,
) -> torch.Tensor:
    """`x @ dequant(W)^T + bias` for x of at most `KERNEL_MAX_ROWS` rows (over its last dim), x
    float32 or bfloat16 (bias of x's dtype); all tensors contiguous CPU tensors. `x_bits` (default
    `default_x_bits(x.dtype)`) is what x is quantized to where the shapes allow: 8 (either
    dtype), 16 (bfloat16 x only), or 32 (float32 x: none, the exact float path)."""
    # Every Python step here runs once per layer per decode step: no reshape (a contiguous x
    # of any shape is the flat [rows, K] the kernel reads), one allocation.
    k = x.shape[-1]
    rows = x.numel() // k
    if not x.is_contiguous():
        x = x.contiguous()
    out = torch.empty(x.shape[:-1] + (out_features,), dtype=x.dtype)
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    status = trace.call(
        lib,
        "tw_qgemv",
        *trace.ptrs(x, qweight, scales, offsets, bias, out),
        rows,
        out_features,
        k,
        bits,
        group_size,
        int(scales.dtype == torch.float32),
        int(x.dtype == torch.bfloat16),
        default_x_bits(x.dtype) if x_bits is None else x_bits,
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
        *trace.ptrs(qweight, scales, offsets, out),
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


def rows(
    lib: ctypes.CDLL,
    ids: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    bits: int,
    group_size: int,
    k: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Rows `ids` (valid row indices, any shape) of the dense weight in `dtype` (float32 or
    bfloat16), `[*ids.shape, k]`: a quantized embedding's lookup, as `dequantize` writes rows."""
    flat = ids.reshape(-1)
    if flat.dtype != torch.int64 or not flat.is_contiguous():
        flat = flat.to(torch.int64).contiguous()
    out = torch.empty(ids.shape + (k,), dtype=dtype)
    status = trace.call(
        lib,
        "tw_qrows",
        *trace.ptrs(qweight, scales, offsets, flat),
        flat.numel(),
        out.data_ptr(),
        k,
        bits,
        group_size,
        int(scales.dtype == torch.float32),
        int(dtype == torch.bfloat16),
    )
    if status != 0:
        raise RuntimeError(f"looking up int{bits} rows of width {k} failed (status {status})")
    return out
