"""Build, load and call the C decode kernel of the gated delta rule (`gdn_decode.c`).

A Gated DeltaNet layer's decode step reads and writes its whole recurrent state per request
(32 heads of 128 x 128 float32 on Qwen3.5: 2 MiB per layer and request), so the step is bound
by memory bandwidth. The torch form (`models.gated_delta_rule.delta_rule_step`) gathers the
states of the batch's slots, runs about eight ops each writing a state-sized temporary, and
scatters them back; the kernel updates each slot's state in place in two passes over it.

`gated_delta_decode` returns None where the kernel does not apply (the layer then runs the
torch form): a device other than CPU, a state dtype other than float32 or bfloat16 (a bf16
model keeps bf16 states: the kernel widens each head to float32 and rounds it back, half the
bytes of the float32 form to move), no usable compiler, or `TOKENWISE_CPU_KERNELS=0`. There
is no GPU kernel: on CUDA the torch form runs (batched over the decode requests), which is
correct but not fast.

Threads: built with `-fopenmp` where torch's runtime is libgomp (the threads torch's matmuls
just used, as `paged_decode`), splitting the (slot, head) pairs once there is enough state.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from tokenwise.native import build

KERNEL = build.Kernel(
    "gdn_decode.c",
    what="the gated delta-rule decode kernel",
    fallback="Gated DeltaNet layers run their torch decode step",
)
CFLAGS = ["-O3", "-march=native", *build.FAST_MATH, "-shared", "-fPIC"]

_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


def _flags() -> list[str]:
    return build.with_torch_openmp(CFLAGS)


@cache
def load() -> ctypes.CDLL | None:
    """The compiled kernel library, or None when it cannot be used on this machine."""
    return KERNEL.load(_flags(), open_library, switchable=True)


def open_library(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.gdn_decode.restype = ctypes.c_int
    lib.gdn_decode.argtypes = [_PTR, _I64, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR]
    lib.gdn_decode.argtypes += [_PTR, _I64, _I64, _I64, _I64]
    lib.gdn_decode_bf16.restype = lib.gdn_decode.restype
    lib.gdn_decode_bf16.argtypes = lib.gdn_decode.argtypes
    return lib


def gated_delta_decode(
    states: torch.Tensor,
    state_offset: int,
    slots: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
) -> torch.Tensor | None:
    """One token per slot, in place: `states` `[num_slots, row]` float32 or bfloat16 (each
    slot's delta-rule state,
    `[nv, dk, dv]`, starting `state_offset` floats into its row), `slots` int64 `[n]`, `q`/`k`
    `[n, nk, dk]` (L2-normalised, q scaled), `v` `[n, nv, dv]`, `g`/`beta` `[n, nv]`.
    Returns `o` `[n, nv, dv]`, or None where the kernel does not apply (see the module)."""
    if states.device.type != "cpu" or states.dim() != 2:
        return None
    if states.dtype not in (torch.float32, torch.bfloat16):
        return None
    if not states.is_contiguous():
        return None
    lib = load()
    if lib is None:
        return None
    n, nk, dk = k.shape
    nv, dv = v.shape[1:]
    if state_offset + nv * dk * dv > states.shape[1]:
        raise ValueError(
            f"delta-rule state ({nv} heads x {dk} x {dv}) at offset {state_offset} does not fit "
            f"a state row of {states.shape[1]} values"
        )
    q, k, v, g, beta = (x.float().contiguous() for x in (q, k, v, g, beta))
    slots = slots.to(torch.int64).contiguous()
    if n and not 0 <= int(slots.min()) <= int(slots.max()) < states.shape[0]:
        raise ValueError(f"state slots must lie in [0, {states.shape[0]}), got {slots.tolist()}")
    out = torch.empty(n, nv, dv, dtype=torch.float32)
    kernel = lib.gdn_decode if states.dtype == torch.float32 else lib.gdn_decode_bf16
    status = kernel(
        states.data_ptr(),
        states.shape[1],
        state_offset,
        slots.data_ptr(),
        n,
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        g.data_ptr(),
        beta.data_ptr(),
        out.data_ptr(),
        nk,
        nv,
        dk,
        dv,
    )
    if status != 0:
        raise ValueError(
            f"gated delta-rule decode kernel refused nk={nk}, nv={nv}, dk={dk}, dv={dv} (nv must "
            "be a multiple of nk, dv at most 4096, and dk x dv at most 65536 for bf16 states)"
        )
    return out
