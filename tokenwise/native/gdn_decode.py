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

from tokenwise.native import build, trace

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
    lib.gdn_decode_step.restype = ctypes.c_int
    lib.gdn_decode_step.argtypes = [_PTR, _I64, _PTR, _PTR, _I64, _I64, _PTR, _I64, _PTR, _I64]
    lib.gdn_decode_step.argtypes += [_PTR, _PTR, _PTR, ctypes.c_float, _PTR, _I64, _I64, _I64]
    lib.gdn_decode_step.argtypes += [_I64, _I64]
    lib.gdn_decode_step_packed.restype = ctypes.c_int
    lib.gdn_decode_step_packed.argtypes = [_PTR]
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


def index_tensor(values: list[int]) -> torch.Tensor:
    """int64 indices (token rows, state slots) as `gated_delta_decode_step` takes them."""
    return torch.tensor(values, dtype=torch.int64)


def gated_delta_decode_step(
    proj: torch.Tensor,
    rows: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    conv_weight: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    heads: tuple[int, int, int, int],
) -> bool:
    """A Gated DeltaNet layer's whole decode step between `in_proj` and `out_proj` for the
    tokens `rows` of `proj` (`in_proj`'s output `[T, channels + nv dv + 2 nv]`), each
    the one token of the request in state slot `slots[i]` (conv state, then delta-rule state,
    updated in place; a negative slot is a padding row: zero state, nothing written), written
    to the same rows of `out` `[T, nv dv]`: the causal conv and its SiLU, the L2 norms, the
    gates, the delta rule and the gated RMSNorm (`gdn_decode.c`). `rows` and `slots` are int64
    tensors of one length (`index_tensor`), read by the kernel when it runs: a CPU graph
    records their addresses, and the runner refills them before each replay
    (`runner/recurrent_graph.py`), as it does block tables. `heads` is (nk, nv, dk, dv),
    `conv_weight` `[channels, K]`. Every float tensor float32, or every one bfloat16. Returns
    False (nothing done) where the kernel does not apply."""
    dtype = proj.dtype
    tensors = (proj, states, conv_weight, a_log, dt_bias, norm_weight, out)
    if dtype not in (torch.float32, torch.bfloat16) or proj.device.type != "cpu":
        return False
    if any(t.dtype != dtype or not t.is_contiguous() for t in tensors):
        return False
    if (lib := load()) is None:
        return False
    nk, nv, dk, dv = heads
    channels, taps = conv_weight.shape
    if proj.shape[1] != channels + nv * dv + 2 * nv or out.shape[1] != nv * dv:
        raise ValueError(
            f"in_proj output width {proj.shape[1]} / output width {out.shape[1]} do not match "
            f"{channels} conv channels and {nv} value heads of {dv}"
        )
    if states.shape[1] < (taps - 1) * channels + nv * dk * dv:
        raise ValueError(f"a state row of {states.shape[1]} values cannot hold this layer's state")
    if rows.shape != slots.shape or rows.dim() != 1:
        raise ValueError(f"token rows {tuple(rows.shape)} and state slots {tuple(slots.shape)} "
                         "must be 1-D and of one length")  # fmt: skip
    if rows.dtype != torch.int64 or slots.dtype != torch.int64:
        raise ValueError(f"token rows and state slots must be int64, got {rows.dtype}, "
                         f"{slots.dtype}")  # fmt: skip
    if rows.numel() > min(proj.shape[0], out.shape[0]):
        raise ValueError(f"{rows.numel()} token rows but {proj.shape[0]} rows of input")
    status = trace.call(
        lib, "gdn_decode_step", proj.data_ptr(), proj.shape[1], rows.data_ptr(),
        states.data_ptr(), states.shape[1], states.shape[0], slots.data_ptr(), rows.numel(),
        conv_weight.data_ptr(), taps, a_log.data_ptr(), dt_bias.data_ptr(),
        norm_weight.data_ptr(), eps, out.data_ptr(), nk, nv, dk, dv, int(dtype == torch.bfloat16),
    )  # fmt: skip
    if status != 0:
        raise ValueError(
            f"Gated DeltaNet decode step refused nk={nk}, nv={nv}, dk={dk}, dv={dv}, K={taps} "
            f"(status {status}: nv a multiple of nk, dv <= 4096, dk x dv <= 65536, every slot "
            f"below {states.shape[0]})"
        )
    return True
