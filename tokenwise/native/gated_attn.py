"""Build, load and call the C glue of a gated full-attention layer (`gated_attn.c`).

Qwen3.5 / Qwen3-Next full-attention layers norm q and k per head with a zero-centred scale,
rotate only part of each head, and scale the attention output by `sigmoid(gate)`; their decoder
layers add two residuals. At decode size these are three C calls (`gated_qk`, `sigmoid_gate`,
`add`) instead of some forty torch ops, and calls a CPU graph can record (`native.trace`).

Each function returns None where its kernel does not apply (more than `fused.MAX_ROWS` tokens,
a dtype other than float32 / bfloat16, a layout it does not take, no compiler,
`TOKENWISE_CPU_FUSED=0`); the caller then runs its torch code. Built like `fused.c`: no
OpenMP (a token's glue is microseconds), no FMA contraction or fast-math flags.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from tokenwise.native import build, fused, trace

KERNEL = build.Kernel(
    "gated_attn.c",
    what="the gated-attention glue kernels",
    fallback="gated attention layers keep their torch ops",
)
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


@cache
def load() -> ctypes.CDLL | None:
    """The compiled library, or None where it is switched off or cannot be built."""
    if not fused.enabled():
        return None
    return KERNEL.load(fused.FLAGS, open_library)


def open_library(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.tw_gated_qk.argtypes = [_PTR, _I64, _PTR, _PTR, _PTR, _PTR, ctypes.c_float]
    lib.tw_gated_qk.argtypes += [_I64] * 5 + [_PTR, _PTR, _I64]
    lib.tw_sigmoid_gate.argtypes = [_PTR, _PTR] + [_I64] * 4 + [_PTR, _I64]
    lib.tw_add.argtypes = [_PTR, _PTR, _PTR, _I64, _I64]
    for name in ("tw_gated_qk", "tw_sigmoid_gate", "tw_add"):
        getattr(lib, name).restype = ctypes.c_int
        packed = getattr(lib, name + "_packed")
        packed.restype, packed.argtypes = ctypes.c_int, [_PTR]
    return lib


def _lib_for(x: torch.Tensor) -> ctypes.CDLL | None:
    """The library where `x` (a decode step's rows, float32 or bf16 on CPU) fits it."""
    if not fused._eligible(x) or x.dim() != 2 or not 0 < x.shape[0] <= fused.MAX_ROWS:
        return None
    return load()


def gated_qk(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    heads: tuple[int, int, int, int],
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """q `[T, heads d]` and k `[T, kv_heads d]` of the fused projection `qkv` (rows: per head
    q then gate, then k, then v), zero-centred-normed per head and rotated (neox) over the first
    `rot` channels at `positions`. `heads` is (heads, kv_heads, d, rot)."""
    num_heads, kv_heads, d, rot = heads
    lib = _lib_for(qkv)
    if lib is None or qkv.stride(1) != 1 or qkv.shape[1] < (2 * num_heads + kv_heads) * d:
        return None
    if (
        positions.dtype != torch.int64
        or positions.shape != (qkv.shape[0],)  # multimodal RoPE's [3, T] positions: torch
        or not positions.is_contiguous()
        or cos_sin_cache.dtype != torch.float32
        or not cos_sin_cache.is_contiguous()
        or cos_sin_cache.shape[-1] != rot
        or any(w.dtype != qkv.dtype or not w.is_contiguous() for w in (q_weight, k_weight))
    ):
        return None
    tokens = qkv.shape[0]
    q = torch.empty(tokens, num_heads * d, dtype=qkv.dtype)
    k = torch.empty(tokens, kv_heads * d, dtype=qkv.dtype)
    status = trace.call(
        lib, "tw_gated_qk", qkv.data_ptr(), qkv.stride(0), positions.data_ptr(),
        cos_sin_cache.data_ptr(), q_weight.data_ptr(), k_weight.data_ptr(), eps, tokens,
        num_heads, kv_heads, d, rot, q.data_ptr(), k.data_ptr(), int(qkv.dtype == torch.bfloat16),
    )  # fmt: skip
    if status != 0:
        raise ValueError(f"gated attention q/k kernel refused head_dim={d}, rotary dim={rot}")
    return q, k


def sigmoid_gate(attn: torch.Tensor, qkv: torch.Tensor, heads: int, d: int) -> torch.Tensor | None:
    """`attn * sigmoid(gate)`: `attn` `[T, heads d]`, each head's gate the d values after its q
    in `qkv`'s row."""
    lib = _lib_for(attn)
    if lib is None or not attn.is_contiguous() or qkv.dtype != attn.dtype or qkv.stride(1) != 1:
        return None
    out = torch.empty_like(attn)
    trace.call(
        lib, "tw_sigmoid_gate", attn.data_ptr(), qkv.data_ptr(), qkv.stride(0), attn.shape[0],
        heads, d, out.data_ptr(), int(attn.dtype == torch.bfloat16),
    )  # fmt: skip
    return out


def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """`a + b` of two contiguous tensors of one shape and dtype."""
    lib = _lib_for(a)
    if lib is None or b.shape != a.shape or b.dtype != a.dtype:
        return None
    if not (a.is_contiguous() and b.is_contiguous()):
        return None
    out = torch.empty_like(a)
    trace.call(
        lib, "tw_add", a.data_ptr(), b.data_ptr(), out.data_ptr(), a.numel(),
        int(a.dtype == torch.bfloat16),
    )  # fmt: skip
    return out
