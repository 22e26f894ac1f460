"""CPU graphs: a decode step's C kernel calls, recorded once and replayed from C.

At one token per step a CPU decode forward is a few C kernels per layer (RMSNorm, the linear
layers, RoPE, attention, the gated activation) joined by Python that costs as much as they do:
on the 100M Llama shape with int4 weights, 1.9 ms of a 4.6 ms forward was module calls, checks,
allocations and ctypes conversions. A GPU removes that overhead with a CUDA graph; this is the
CPU's counterpart, behind the same `GraphCapturer` interface, so the runner, the dispatcher
and the persistent input buffers are the CUDA graphs' own (`graph_runner.py`,
docs/forward-context.md §2).

`CPUGraphCapturer.capture(fn)` runs `fn` (the whole model on a padded decode batch, over the
input batch's persistent buffers and the capture metadata) three times:
1. eagerly, so libraries are built and lazy state exists;
2. recording (`native.trace`): every kernel call with its arguments, while a torch
   dispatch guard lets through only views and allocations. Any other op (a matmul torch
   would run, a host read, a collective) means this batch size cannot be replayed: the capture
   is refused with the op's name (`GraphCaptureRejected`) and the runner runs that size eagerly;
3. as a replay, after every tensor allocated during the recording was filled with a sentinel:
   the output must equal the recorded run's bit for bit, or the capture is refused (a kernel
   called around `native.trace` would leave sentinels behind).
The tensors allocated while recording stay alive with the graph (their addresses are in the
recorded arguments), like a CUDA graph's private pool; `replay()` rewrites them in place. The
replay loop itself is C (`tokenwise/native/graph.c`, loaded by `native.graph`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tokenwise.native import graph, trace

# Allocations (outputs the kernels fill) are the only ops besides views a recording may run.
_ALLOCATIONS = frozenset(
    {
        torch.ops.aten.empty.memory_format,
        torch.ops.aten.empty_like.default,
        torch.ops.aten.empty_strided.default,
        torch.ops.aten.new_empty.default,
    }
)
# What tensors allocated during a recording are filled with before the check replay.
_SENTINEL = -1.5e38


class GraphCaptureRejected(RuntimeError):
    """This forward cannot be replayed from recorded kernels (the message says why)."""


class _KernelOnlyGuard(TorchDispatchMode):
    """Lets views and allocations through (keeping every allocation); refuses any other op."""

    def __init__(self) -> None:
        super().__init__()
        self.allocated: list[torch.Tensor] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _ALLOCATIONS:
            out = func(*args, **kwargs)
            self.allocated.append(out)
            return out
        if func.is_view:
            return func(*args, **kwargs)
        raise GraphCaptureRejected(
            f"the forward runs {func} outside the C kernels, which a CPU graph cannot replay"
        )


def _tensors(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _tensors(item)]
    return []


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, so that equality is bitwise (NaNs included)."""
    return t.contiguous().view(torch.uint8)


class CPUGraphCapturer:
    """One recorded forward (see the module); the `GraphCapturer` of CPU devices."""

    def __init__(self) -> None:
        self.calls: list[trace.RecordedCall] = []
        self._keep: list[torch.Tensor] = []
        self._arrays: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._status = ctypes.c_int(0)
        self.num_replays = 0

    def capture(self, fn: Callable[[], Any]) -> Any:
        lib = graph.load()
        if lib is None:
            raise GraphCaptureRejected("the CPU graph replay loop could not be built")
        fn()  # warm-up: libraries loaded, lazily built state in place
        guard = _KernelOnlyGuard()
        with trace.recording() as rec, guard:
            output = fn()
        if not rec.calls:
            raise GraphCaptureRejected("the forward called no C kernel")
        self.calls, self._keep = rec.calls, guard.allocated
        offsets = np.cumsum([0] + [len(c.args) for c in rec.calls[:-1]], dtype=np.int64)
        entries = np.array([c.entry for c in rec.calls], dtype=np.int64)
        args = np.array([a for c in rec.calls for a in c.args], dtype=np.int64)
        self._arrays = (entries, offsets, args)
        self._check(output)
        return output

    def _check(self, output: Any) -> None:
        """Replay once over sentinel-filled temporaries: the output must come back exactly."""
        expected = [_bits(t).clone() for t in _tensors(output)]
        for t in self._keep:
            if t.is_floating_point():
                t.fill_(_SENTINEL)
            elif t.dtype != torch.bool:
                t.fill_(torch.iinfo(t.dtype).min)
        self.replay()
        for want, got in zip(expected, _tensors(output), strict=True):
            if not torch.equal(want, _bits(got)):
                raise GraphCaptureRejected(
                    "replaying the recorded kernels did not reproduce the forward's output "
                    "(a kernel call bypassed the recording)"
                )

    def replay(self) -> None:
        assert self._arrays is not None, "replay() before capture()"
        lib = graph.load()
        assert lib is not None
        failed = graph.replay(lib, *self._arrays, self._status)
        self.num_replays += 1
        if failed:
            call = self.calls[failed - 1]
            raise RuntimeError(
                f"CPU graph replay: kernel {call.name!r} (call {failed} of {len(self.calls)}) "
                f"failed with status {self._status.value}"
            )


def cpu_capturer_factory() -> Callable[[], CPUGraphCapturer]:
    return CPUGraphCapturer
