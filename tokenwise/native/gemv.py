"""Decode-sized CPU linear layers (at most `max_rows(dtype)` rows) through a C kernel that
streams each weight row once, at close to the memory bandwidth.

Batch-1 decode is bound by weight bytes: every step reads every weight once for one row of
activations. oneDNN's prepacked linear (`cpu_prepack`) and `F.linear` reach about half the
machine's bandwidth there. `gemv.c` loads each weight row once for all rows of `x` (they
stay in L1), a few weight rows at a time, split over torch's OpenMP threads in contiguous
ranges; bf16 weights are read as bf16 (half the bytes of the float32 copy oneDNN uses on
CPUs without bf16 kernels) and accumulated in float32.

Measured with `python benchmarks/linear_bandwidth.py` (2 threads; CPU flags avx2, avx512f/bw/
vl, avx512_bf16, avx512_vnni, amx_bf16; weights cycled over >= 1 GiB of copies so they come
from memory; memory read bandwidth in the same run, `torch.sum` over 24 MiB chunks: 31.4
GB/s): at M=1 on the Qwen3-0.6B shape's layers the kernel read 30-31 GB/s in float32 (97-99%
of that bandwidth; prepacked 27-29, F.linear 30-31) and 27-28 GB/s in bf16 (86-92%; prepacked
26-27, F.linear 19-23). At 4-8 bf16 rows oneDNN's AMX kernels win (the kernel drops to 16-21
GB/s, compute-bound), hence the per-dtype `MAX_ROWS`.

At one row the kernel walks the weight rows in order, one contiguous stream per thread
(`gemv_row.h`): blocks of 4 rows read side by side, the former path, made 4 short streams
that the hardware prefetchers follow poorly. On an AVX-512 EPYC (2 vCPUs, shared) that took
float32 built for haswell from 14-21 to 25-27 GB/s per thread on the Llama ~100M and Qwen3-0.6B
layer shapes (a plain sum over the same bytes: 27-30 GB/s), bf16 with vdpbf16ps from 12-17 to
22-27 GB/s.

On AVX2 + FMA (16 vector registers) more than 2 rows of x go through a blocked path: register
tiles of 3 weight rows by 4 rows of x, each block of weight rows read from memory once and
then from the cache against every tile of x. A 2-core EPYC built for haswell (oneDNN capped
at AVX2) read 20-28 GB/s of float32 weights at 4-8 rows there, 1.1-1.4x oneDNN's prepacked
sgemm, 1.1x at 12 rows, even at 16 and behind it from 32, where the work is compute-bound and
oneDNN's packed layout needs no horizontal sums: hence `MAX_ROWS_BY_ISA`, up to 12 rows on
AVX2.

The kernel is built at first use by `native.build` (as every native kernel is) and
used only where it is expected to be faster: an AVX2 or AVX-512 build, torch's OpenMP runtime
being GNU libgomp (so the kernel runs on torch's threads), eager mode (not under
`torch.compile`, which lowers its own matmuls), no autograd, contiguous float32/bfloat16
weights. Elsewhere, and with `TOKENWISE_CPU_GEMV=0`, layers keep the prepacked / `F.linear`
path. A failed build logs a warning once and falls back the same way.
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
    "gemv.c",
    what="the small-M CPU linear kernel",
    fallback="linear layers keep oneDNN/F.linear",
    needs_libgomp=True,
)
# The most rows the engine sends the kernel, per vector path and dtype: where it was as fast as
# or faster than the prepacked path in benchmarks/linear_bandwidth.py (2 threads). AVX-512 +
# AVX512_BF16 + AMX: float32 1.0-1.25x at 1 to 8 rows (the LM head at 4-8 rows 0.93-0.95x);
# bf16 1.0-1.4x at 1 row, 0.9-1.5x at 2, 0.6-0.85x at 4 and 8, where oneDNN's bf16 kernels
# (AMX) win on compute. AVX2 + FMA (an AVX-512 EPYC built for haswell, oneDNN capped at AVX2,
# the Qwen3-0.6B shape's qkv / o / gate_up / down): float32 1.1-1.4x at 1-8 rows (the blocked
# path from 3), 1.1x at 12, 0.94-1.0x at 16 and 0.77-0.9x at 32-64, where oneDNN's packed
# sgemm wins; bf16 1.2-2.3x at 1-4 rows and 1.0-1.7x at 8 (oneDNN has no AVX2 bf16 kernel:
# it multiplies a float32 copy, twice the bytes), 0.8-1.4x at 16.
MAX_ROWS_BY_ISA = {
    1: {torch.float32: 12, torch.bfloat16: 12},
    2: {torch.float32: 8, torch.bfloat16: 2},
    3: {torch.float32: 8, torch.bfloat16: 2},
}
# The AVX-512 limits, which the tests and the CPU linear path's docs quote.
MAX_ROWS = MAX_ROWS_BY_ISA[3]
# Rows the kernel itself accepts (beyond its routed limits: benchmarks and tests call it there).
KERNEL_MAX_ROWS = 64
DTYPES = tuple(MAX_ROWS)
ISA_NAMES = {0: "plain C", 1: "AVX2", 2: "AVX-512", 3: "AVX-512 + AVX512_BF16"}

_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


def enabled() -> bool:
    """Whether `TOKENWISE_CPU_GEMV` allows the kernel (on unless 0/false/off/no)."""
    setting = envs.get("TOKENWISE_CPU_GEMV").strip().lower()
    return setting not in ("0", "false", "off", "no")


def _flags() -> list[str]:
    return build.OPENMP_FLAGS


@cache
def load() -> ctypes.CDLL | None:
    """The compiled kernel, or None where it is switched off, cannot be built, or would not
    be faster than the prepacked path (no vector ISA, or no libgomp to share threads with)."""
    if not enabled():
        return None
    lib = KERNEL.load(_flags(), open_library)
    if lib is None:
        return None
    isa = lib.tw_gemv_isa()
    if isa == 0:
        logger.info("small-M CPU linear kernel not used: no AVX2 or AVX-512 on this CPU")
        return None
    logger.info("small-M CPU linear kernel built for %s", ISA_NAMES.get(isa, isa))
    lib.max_rows = MAX_ROWS_BY_ISA.get(isa, MAX_ROWS)  # read on every linear call: no ctypes call
    return lib


def open_library(path: Path) -> ctypes.CDLL:
    """The built kernel at `path`, its functions typed."""
    lib = ctypes.CDLL(str(path))
    lib.tw_gemv_isa.restype = ctypes.c_int
    fn = lib.tw_gemv
    fn.restype = ctypes.c_int
    fn.argtypes = [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, ctypes.c_int, ctypes.c_int]
    lib.tw_gemv_packed.restype, lib.tw_gemv_packed.argtypes = ctypes.c_int, [_PTR]
    return lib


def max_rows(dtype: torch.dtype) -> int:
    """The most rows of `dtype` that `cpu_prepack.linear` sends the kernel on this CPU: 0 where
    the kernel is not loaded."""
    lib = load()
    return 0 if lib is None else lib.max_rows.get(dtype, 0)


def isa_name(lib: ctypes.CDLL) -> str:
    return ISA_NAMES.get(lib.tw_gemv_isa(), "unknown")


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear(x, weight)` may go through the kernel (not counting the row limit)."""
    return (
        weight.dtype in DTYPES
        and weight.dim() == 2
        and weight.is_contiguous()
        and not torch.compiler.is_compiling()
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    )


def linear(
    lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for x of at most `KERNEL_MAX_ROWS` rows (over its last dim), all
    CPU tensors of one dtype in `DTYPES`; the caller checks with `usable`."""
    n, k = weight.shape
    rows = x.numel() // k if k else 0
    x2 = x if x.dim() == 2 else x.reshape(rows, k)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    out = torch.empty((rows, n) if x.dim() == 2 else (*x.shape[:-1], n), dtype=x.dtype)
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    status = trace.call(
        lib,
        "tw_gemv",
        *trace.ptrs(x2, weight, bias, out),
        rows,
        n,
        k,
        int(x.dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    if status != 0:
        raise RuntimeError(f"CPU linear kernel failed (status {status}) for {rows}x{k} @ {n}x{k}")
    return out
