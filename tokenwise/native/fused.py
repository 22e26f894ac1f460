"""RMSNorm (with its residual add), neox-style RoPE, SwiGLU's gated activation and the
embedding lookup for decode-sized CPU tensors, one C call each (`fused.c`), with results
bit for bit those of the torch code they replace (the activation within a rounding: its
exponential is not torch's); and a row argmax for the sampler (torch's CPU argmax is several
times slower than a plain scan). All but the argmax can be recorded into a CPU graph
(`native.trace`).

At one token per step the torch versions of these ops spend their time in dispatch, not in
arithmetic: an RMSNorm with residual is nine ops, a RoPE of q and k about fifteen, and a
12-layer model runs 25 norms and 12 RoPEs per step. Each module asks `rms_norm` / `rope_neox`
first and keeps its torch code for everything they decline (None): more than `MAX_ROWS`
tokens (prefill chunks, where torch's per-op cost is spread over many rows and its threads
help), dtypes other than float32 and bfloat16, non-contiguous rows, tensors that need
autograd, `torch.compile` (which fuses these ops itself), or no usable compiler
(`TOKENWISE_CPU_FUSED=0` switches the kernels off too).

The library is built at first use by `native.build`, without OpenMP (one row is a few
microseconds) and without any fast-math flag or FMA contraction, which would change the
rounding.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from tokenwise import envs
from tokenwise.native import build, trace

KERNEL = build.Kernel(
    "fused.c", what="the RMSNorm/RoPE/activation kernels", fallback="layers keep their torch ops"
)
FLAGS = [*build.BASE_FLAGS, "-ffp-contract=off"]
DTYPES = (torch.float32, torch.bfloat16)
# Tokens per call at most: decode steps (one row per running sequence), not prefill chunks.
MAX_ROWS = 64
MAX_NORM_SIZE = 65536  # a norm over more values than any model's hidden size: torch's ops
MAX_HEAD_DIM = 1024

_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


def enabled() -> bool:
    """Whether `TOKENWISE_CPU_FUSED` allows the kernels (on unless 0/false/off/no)."""
    setting = envs.get("TOKENWISE_CPU_FUSED").strip().lower()
    return setting not in ("0", "false", "off", "no")


@cache
def load() -> ctypes.CDLL | None:
    """The compiled library, or None where it is switched off or cannot be built."""
    if not enabled():
        return None
    return KERNEL.load(FLAGS, open_library)


def open_library(path: Path) -> ctypes.CDLL:
    """The built kernels at `path`, their functions typed."""
    lib = ctypes.CDLL(str(path))
    lib.tw_rms_norm.restype = ctypes.c_int
    lib.tw_rms_norm.argtypes = [_PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, ctypes.c_float]
    lib.tw_rms_norm.argtypes += [ctypes.c_int, _I64, _I64, ctypes.c_int]
    lib.tw_rope_neox.restype = None
    lib.tw_rope_neox.argtypes = [_PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64]
    lib.tw_rope_neox.argtypes += [_I64, _I64, ctypes.c_int]
    lib.tw_argmax.restype = None
    lib.tw_argmax.argtypes = [_PTR, _I64, _I64, _PTR]
    lib.tw_act_mul.restype = ctypes.c_int
    lib.tw_act_mul.argtypes = [_PTR, _PTR, _I64, _I64, ctypes.c_int, ctypes.c_int]
    lib.tw_embed_rows.restype = ctypes.c_int
    lib.tw_embed_rows.argtypes = [_PTR, _PTR, _I64, _I64, _PTR]
    for name in ("tw_rms_norm", "tw_rope_neox", "tw_act_mul", "tw_embed_rows"):
        packed = getattr(lib, name + "_packed")
        packed.restype, packed.argtypes = ctypes.c_int, [_PTR]
    return lib


def _eligible(x: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype in DTYPES
        and not torch.compiler.is_compiling()
        and not (x.requires_grad and torch.is_grad_enabled())
    )


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    gemma: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """`(norm(x + residual), x + residual)` (or `(norm(x), None)`) as `RMSNorm` computes them
    (`gemma`: as `GemmaRMSNorm` does, the scale `1 + weight` in float32), rows over the last
    dimension; None where the kernel does not apply (see the module)."""
    n = x.shape[-1] if x.dim() else 0
    # Tokens, not rows: a per-head norm has a row per head of each token.
    tokens = x.shape[0] if x.dim() == 3 else (x.numel() // n if n else 0)
    if not (_eligible(x) and 0 < n <= MAX_NORM_SIZE and tokens <= MAX_ROWS):
        return None
    if weight.dtype != x.dtype or not weight.is_contiguous():
        return None
    layout = _row_groups(x, n)
    if layout is None:
        return None
    if residual is not None and (
        residual.dtype != x.dtype
        or residual.shape != x.shape
        or not (residual.is_contiguous() and x.is_contiguous())
    ):
        return None
    lib = load()
    if lib is None:
        return None
    out = torch.empty(x.shape, dtype=x.dtype)
    summed = None if residual is None else torch.empty(x.shape, dtype=x.dtype)
    status = trace.call(
        lib,
        "tw_rms_norm",
        x.data_ptr(),
        None if residual is None else residual.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        None if summed is None else summed.data_ptr(),
        x.numel() // n,
        n,
        eps,
        int(x.dtype == torch.bfloat16),
        *layout,
        int(gemma),
    )
    if status != 0:
        raise MemoryError("RMSNorm kernel could not allocate its scratch rows")
    return out, summed


def _row_groups(x: torch.Tensor, n: int) -> tuple[int, int] | None:
    """(rows per group, values between groups) of `x`'s rows of `n`: one group when `x` is
    contiguous; else a 2-D view with strided rows (groups of one row) or a 3-D view
    [tokens, heads, n] whose heads are contiguous within a token (a per-head q/k norm over the
    fused qkv output); None for other layouts."""
    rows = x.numel() // n
    if x.is_contiguous():
        return rows, rows * n
    if x.dim() == 2 and x.stride(1) == 1:
        return 1, x.stride(0)
    if x.dim() == 3 and x.stride(2) == 1 and (x.shape[1] == 1 or x.stride(1) == n):
        return x.shape[1], x.stride(0)
    return None


def rope_neox(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`query` and `key` ([tokens, heads * head_dim] or [tokens, heads, head_dim]) rotated
    neox style at `positions`, as `RotaryEmbedding` computes them, in new contiguous tensors of
    their shapes; None where the kernel does not apply. Token rows may be strided (views into a
    fused qkv output); within a row the heads must be contiguous."""
    tokens = query.shape[0] if query.dim() else 0
    if not (_eligible(query) and 0 < tokens <= MAX_ROWS and 0 < head_dim <= MAX_HEAD_DIM):
        return None
    q_width, k_width = query.numel() // tokens, key.numel() // tokens
    if (
        key.dtype != query.dtype
        or key.shape[0] != tokens
        or q_width % head_dim
        or k_width % head_dim
        or cos_sin_cache.dtype != torch.float32
        or positions.dtype != torch.int64
        or not (positions.is_contiguous() and cos_sin_cache.is_contiguous())
        or not (_rows_contiguous(query) and _rows_contiguous(key))
    ):
        return None
    lib = load()
    if lib is None:
        return None
    q_out = torch.empty(query.shape, dtype=query.dtype)
    k_out = torch.empty(key.shape, dtype=key.dtype)
    trace.call(
        lib,
        "tw_rope_neox",
        query.data_ptr(),
        key.data_ptr(),
        q_out.data_ptr(),
        k_out.data_ptr(),
        positions.data_ptr(),
        cos_sin_cache.data_ptr(),
        tokens,
        q_width // head_dim,
        k_width // head_dim,
        head_dim,
        query.stride(0),
        key.stride(0),
        int(query.dtype == torch.bfloat16),
    )
    return q_out, k_out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """`silu(gate) * up` of `x` = `[..., gate | up]` as `SiluAndMul` computes it (its
    exponential aside: see `fused.c`), in a new contiguous tensor; None where the kernel
    does not apply (see the module)."""
    width = x.shape[-1] if x.dim() else 0
    if not (_eligible(x) and width and width % 2 == 0 and x.numel() <= MAX_ROWS * width):
        return None
    if not x.is_contiguous():
        return None
    lib = load()
    if lib is None:
        return None
    d = width // 2
    out = torch.empty(x.shape[:-1] + (d,), dtype=x.dtype)
    trace.call(
        lib,
        "tw_act_mul",
        x.data_ptr(),
        out.data_ptr(),
        x.numel() // width,
        d,
        0,
        int(x.dtype == torch.bfloat16),
    )
    return out


def embedding_rows(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor | None:
    """`F.embedding(ids, table)` for a few int64 ids (a decode step's) by row copies; None
    where the kernel does not apply. The ids must be valid rows (the engine checks prompts
    against the vocabulary; sampled ids are inside it)."""
    if not (
        _eligible(table)
        and ids.device.type == "cpu"
        and ids.dtype == torch.int64
        and ids.is_contiguous()
        and 0 < ids.numel() <= MAX_ROWS
        and table.dim() == 2
        and table.is_contiguous()
    ):
        return None
    lib = load()
    if lib is None:
        return None
    out = torch.empty(ids.shape + (table.shape[1],), dtype=table.dtype)
    row_bytes = table.shape[1] * table.element_size()
    trace.call(
        lib, "tw_embed_rows", table.data_ptr(), ids.data_ptr(), ids.numel(), row_bytes,
        out.data_ptr(),
    )  # fmt: skip
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)` for a 2-D float32 tensor (first index on ties, a NaN wins), through
    the C kernel for contiguous CPU rows, else torch's."""
    lib = load() if x.device.type == "cpu" else None
    if (
        lib is None
        or x.dtype != torch.float32
        or x.dim() != 2
        or x.shape[1] == 0
        or not x.is_contiguous()
        or torch.compiler.is_compiling()
    ):
        return x.argmax(dim=-1)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    lib.tw_argmax(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
    return out


def _rows_contiguous(x: torch.Tensor) -> bool:
    """Whether each token row of `x` (dim 0) is one contiguous run of values."""
    if x.is_contiguous():
        return True
    if x.dim() == 2:
        return x.stride(1) == 1 or x.shape[1] == 1
    expected = 1
    for size, stride in zip(reversed(x.shape[1:]), reversed(x.stride()[1:]), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True
