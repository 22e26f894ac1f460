"""CUDA-graph capture and replay of one callable, keyed by the forward context.

The keys and modes are docs/forward-context.md §2.

`CUDAGraphWrapper` wraps a callable (a compiled piece between attention calls, or the whole
model) for one runtime mode, PIECEWISE or FULL. Each call reads the forward context: when its
`cudagraph_runtime_mode` is the wrapper's mode, the `batch_descriptor` (the padded batch) picks
a graph, captured on first sight and replayed afterwards; any other mode calls the callable
directly. So the runner decides per step, in one place, and every wrapper obeys.

A graph reads and writes fixed addresses. Arguments marked static (weights, or the runner's
persistent input buffers) are captured by address. The others (activations between pieces,
which attention allocates afresh every step) are copied into buffers owned by the entry before
each replay. The outputs are the tensors the capture returned: replay rewrites them in place, so
a caller must use (or copy) them before the next replay of the same graph.

The capture primitive is injectable (`GraphCapturer`): `CUDAGraphCapturer` uses
`torch.cuda.CUDAGraph`; `EagerReplayCapturer` stands in for it on CPU, so the bookkeeping
(which key, which buffers, what replay sees) is tested without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from tokenwise.config import CUDAGraphMode
from tokenwise.forward_context import (
    BatchDescriptor,
    get_forward_context,
    is_forward_context_available,
)


class GraphCapturer(Protocol):
    """Captures one call of a function and replays it."""

    def capture(self, fn: Callable[[], Any]) -> Any:
        """Record `fn()`; return its output, already computed, in memory replay rewrites."""
        ...

    def replay(self) -> None: ...


CapturerFactory = Callable[[], GraphCapturer]


class CUDAGraphCapturer:
    """A `torch.cuda.CUDAGraph` captured on a side stream into a shared memory pool.

    `capture` runs `fn` once eagerly first (lazy initialisation, kernel compilation and
    autotuning must not happen inside a capture), then records it, then replays it once so the
    returned output holds real values. Sharing one pool lets graphs that never run at the same
    time reuse each other's temporaries.
    """

    def __init__(self, pool: Any, stream: torch.cuda.Stream) -> None:
        self.pool = pool
        self.stream = stream
        self.graph: torch.cuda.CUDAGraph | None = None

    def capture(self, fn: Callable[[], Any]) -> Any:
        torch.cuda.synchronize()
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            fn()  # warm-up
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        # capture_begin/end rather than `torch.cuda.graph(...)`, which would run gc.collect()
        # and empty_cache() for each of the hundreds of graphs a model captures.
        with torch.cuda.stream(self.stream):
            # thread_local: a server's other threads may touch CUDA meanwhile; only this
            # thread's unsafe calls (syncs, fresh host copies) must fail the capture.
            self.graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                output = fn()
            finally:
                self.graph.capture_end()
        torch.cuda.current_stream().wait_stream(self.stream)
        self.graph.replay()
        return output

    def replay(self) -> None:
        assert self.graph is not None, "replay() before capture()"
        self.graph.replay()


def cuda_capturer_factory(device: torch.device) -> CapturerFactory:
    """Capturers for `device` sharing one memory pool and one capture stream."""
    pool = torch.cuda.graph_pool_handle()
    stream = torch.cuda.Stream(device=device)
    return lambda: CUDAGraphCapturer(pool, stream)


def _copy_into(target: Any, source: Any) -> None:
    if isinstance(target, torch.Tensor):
        target.copy_(source)
    elif isinstance(target, (tuple, list)):
        for t, s in zip(target, source, strict=True):
            _copy_into(t, s)


class EagerReplayCapturer:
    """CPU stand-in for a CUDA graph, with the same memory semantics.

    `capture` calls `fn` once and keeps its output tensors; `replay` calls `fn` again and
    copies the result into those same tensors, as a replayed graph writes its fixed output
    memory. `fn` closes over the same persistent inputs a real graph would read, so a test
    sees exactly what a replay would: stale inputs give stale results.
    """

    def __init__(self) -> None:
        self.fn: Callable[[], Any] | None = None
        self.output: Any = None
        self.num_replays = 0

    def capture(self, fn: Callable[[], Any]) -> Any:
        self.fn = fn
        self.output = fn()
        return self.output

    def replay(self) -> None:
        assert self.fn is not None, "replay() before capture()"
        self.num_replays += 1
        _copy_into(self.output, self.fn())


@dataclass
class _Entry:
    capturer: GraphCapturer
    inputs: list[Any]  # what the graph reads: static args as given, the others our buffers
    output: Any


class CUDAGraphWrapper:
    """Capture/replay `runnable` per batch descriptor while the context's mode is `mode`.

    `static_args[i]` says argument i keeps its address between calls (weights, persistent
    buffers); the others are copied into the entry's buffers before each replay. Non-tensor
    arguments (the token count of a piece) must equal their captured values.
    `check_static_addresses` verifies that static tensors did not move (cheap for a few).
    """

    def __init__(
        self,
        runnable: Callable[..., Any],
        mode: CUDAGraphMode,
        capturer_factory: CapturerFactory,
        static_args: Sequence[bool] | None = None,
        name: str = "",
        check_static_addresses: bool = False,
    ) -> None:
        if mode not in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL):
            raise ValueError(f"a graph wrapper is for PIECEWISE or FULL, got {mode}")
        self.runnable = runnable
        self.mode = mode
        self.capturer_factory = capturer_factory
        self.static_args = None if static_args is None else list(static_args)
        self.name = name
        self.check_static_addresses = check_static_addresses
        self.entries: dict[BatchDescriptor, _Entry] = {}

    def __call__(self, *args: Any) -> Any:
        if not is_forward_context_available():
            return self.runnable(*args)
        ctx = get_forward_context()
        key = ctx.batch_descriptor
        if ctx.cudagraph_runtime_mode != self.mode or key is None:
            return self.runnable(*args)
        entry = self.entries.get(key)
        if entry is None:
            return self._capture(key, args)
        self._load_inputs(entry, args)
        entry.capturer.replay()
        return entry.output

    def _is_static(self, i: int) -> bool:
        return self.static_args is not None and self.static_args[i]

    def _capture(self, key: BatchDescriptor, args: tuple[Any, ...]) -> Any:
        inputs = [
            a.clone() if isinstance(a, torch.Tensor) and not self._is_static(i) else a
            for i, a in enumerate(args)
        ]
        capturer = self.capturer_factory()
        runnable = self.runnable
        output = capturer.capture(lambda: runnable(*inputs))
        self.entries[key] = _Entry(capturer, inputs, output)
        return output

    def _load_inputs(self, entry: _Entry, args: tuple[Any, ...]) -> None:
        if len(args) != len(entry.inputs):
            raise RuntimeError(
                f"graph {self.name!r}: called with {len(args)} arguments, captured with "
                f"{len(entry.inputs)}"
            )
        for i, (arg, buf) in enumerate(zip(args, entry.inputs, strict=True)):
            if not isinstance(buf, torch.Tensor):
                if arg != buf:
                    raise RuntimeError(
                        f"graph {self.name!r}: argument {i} is {arg}, captured as {buf}; the "
                        "batch was not padded to the captured size"
                    )
            elif self._is_static(i):
                if self.check_static_addresses and arg.data_ptr() != buf.data_ptr():
                    raise RuntimeError(
                        f"graph {self.name!r}: static argument {i} moved since capture; "
                        "pass the persistent buffer the graph was captured with"
                    )
            elif arg is not buf:
                if arg.shape != buf.shape:
                    raise RuntimeError(
                        f"graph {self.name!r}: argument {i} has shape {tuple(arg.shape)}, "
                        f"captured with {tuple(buf.shape)}"
                    )
                buf.copy_(arg)
