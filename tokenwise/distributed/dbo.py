"""Dual-batch overlap (DBO): two micro-batch threads that take turns at the MoE exchange.

A step cut into two micro-batches (`ubatching.py`) only saves time if one micro-batch's
communication runs while the other computes. Each micro-batch therefore runs the model on its
own thread, and the two play strict ping-pong: exactly one of them runs Python and compute at
any moment; the other is parked. At a yield point (right after the MoE layer *issues* its
asynchronous all-gather or reduce-scatter) the running thread hands the turn over and parks;
when it gets the turn back it waits for its collective, which by then has had the other
micro-batch's whole compute segment to finish in.

Strict alternation also keeps the collectives in the same order on every DP rank (both ranks
run the same schedule), which gloo needs to pair them, and it keeps micro-batch 0 one segment
ahead of micro-batch 1 in every layer, so a request cut by the split writes its first part's KV
before its second part's attention reads it.

Nothing here may hang: every wait (for the turn, for a collective, for a thread to finish) has
a bound, `TOKENWISE_DBO_TIMEOUT_S`, and its error names the micro-batch and the DP rank. An
exception in one thread ends the step with that exception (annotated with the micro-batch) and
unparks the other thread, which unwinds instead of waiting for a turn that will not come.
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

from tokenwise import envs

__all__ = [
    "DualBatchRunner",
    "collective_delay_s",
    "dbo_timeout_s",
    "dbo_current_ubatch",
    "dbo_record",
    "dbo_yield",
    "wait_collective",
]

T = TypeVar("T")

_TIMEOUT_ENV = "TOKENWISE_DBO_TIMEOUT_S"
_DELAY_ENV = "TOKENWISE_MOE_COLLECTIVE_DELAY_MS"
DEFAULT_TIMEOUT_S = 300.0


def _env_float(name: str, default: float, minimum: float, strict: bool) -> float:
    raw = envs.get(name)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (value > minimum if strict else value >= minimum):
        bound = f"> {minimum}" if strict else f">= {minimum}"
        raise ValueError(f"{name} must be a number {bound}, got {raw!r}")
    return value


def dbo_timeout_s() -> float:
    """The bound on every DBO wait, from `TOKENWISE_DBO_TIMEOUT_S` (default 300 s)."""
    return _env_float(_TIMEOUT_ENV, DEFAULT_TIMEOUT_S, 0.0, strict=True)


def collective_delay_s() -> float:
    """`TOKENWISE_MOE_COLLECTIVE_DELAY_MS` in seconds (default 0): a benchmark's stand-in for
    a slow interconnect. An MoE collective then completes no earlier than this long after it
    was issued; the waiting path sleeps the rest (the GIL is released and the other
    micro-batch, which holds the turn meanwhile, is not held up)."""
    return _env_float(_DELAY_ENV, 0.0, 0.0, strict=False) / 1000.0


class _PartnerFailed(BaseException):
    """Unwinds a micro-batch thread whose partner failed (never reaches the caller)."""


class DualBatchRunner:
    """Runs one callable per micro-batch on its own thread, in strict ping-pong.

    `events` records, in order, `(ubatch, kind, detail)` for each turn start, issue, yield and
    wait: what a test reads to check that the micro-batches really interleaved.
    """

    def __init__(self, num_ubatches: int = 2, rank: int = 0, timeout_s: float | None = None):
        if num_ubatches < 1:
            raise ValueError(f"num_ubatches must be >= 1, got {num_ubatches}")
        self.num_ubatches = num_ubatches
        self.rank = rank
        self.timeout_s = dbo_timeout_s() if timeout_s is None else timeout_s
        self.events: list[tuple[int, str, str]] = []
        self._cond = threading.Condition()
        self._turn = 0
        self._done = [False] * num_ubatches
        self._error: tuple[int, BaseException] | None = None

    def _who(self, ubatch: int) -> str:
        return f"micro-batch {ubatch} on DP rank {self.rank}"

    def record(self, ubatch: int, kind: str, detail: str = "") -> None:
        self.events.append((ubatch, kind, detail))

    # ---- the turn -------------------------------------------------------------------------

    def _wait_for_turn(self, ubatch: int) -> None:
        """Park until it is `ubatch`'s turn (or the partner failed); caller holds the lock."""
        deadline = time.monotonic() + self.timeout_s
        while self._turn != ubatch and self._error is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"{self._who(ubatch)} waited more than {self.timeout_s:g}s for its turn; "
                    f"micro-batch {self._turn} still holds it (last events: {self.events[-4:]}); "
                    f"raise {_TIMEOUT_ENV} if a segment really takes this long"
                )
            self._cond.wait(left)
        if self._error is not None and self._error[0] != ubatch:
            raise _PartnerFailed

    def _pass_turn(self, ubatch: int) -> bool:
        """Give the turn to the next unfinished micro-batch; False if there is none."""
        for step in range(1, self.num_ubatches):
            other = (ubatch + step) % self.num_ubatches
            if not self._done[other]:
                self._turn = other
                self._cond.notify_all()
                return True
        return False

    def yield_turn(self, ubatch: int, detail: str = "") -> None:
        """Hand the turn to the other micro-batch and park until it comes back."""
        with self._cond:
            if self._error is not None:
                raise _PartnerFailed
            if not self._pass_turn(ubatch):
                return  # the other one has finished: keep running
            self.record(ubatch, "yield", detail)
            self._wait_for_turn(ubatch)
            self.record(ubatch, "resume", detail)

    # ---- threads --------------------------------------------------------------------------

    def _thread_main(self, ubatch: int, fn: Callable[[], Any], results: list[Any]) -> None:
        _current.set((self, ubatch))
        try:
            with self._cond:
                self._wait_for_turn(ubatch)
                self.record(ubatch, "start")
            results[ubatch] = fn()
        except _PartnerFailed:
            pass
        except BaseException as exc:
            with self._cond:
                if self._error is None:
                    self._error = (ubatch, exc)
        finally:
            with self._cond:
                self._done[ubatch] = True
                self.record(ubatch, "done")
                if self._turn == ubatch:
                    self._pass_turn(ubatch)
                self._cond.notify_all()

    def run(self, fns: Sequence[Callable[[], T]]) -> list[T]:
        """Run `fns[i]` as micro-batch i (0 first) and return their results in order.

        Each callable runs on a fresh thread: it must install its own thread-local state
        (forward context, inference mode). The first exception raised by a micro-batch is
        re-raised here, with a note naming it.
        """
        if len(fns) != self.num_ubatches:
            raise ValueError(f"expected {self.num_ubatches} callables, got {len(fns)}")
        results: list[Any] = [None] * self.num_ubatches
        threads = [
            threading.Thread(
                target=self._thread_main,
                args=(i, fn, results),
                name=f"tokenwise-ubatch-{i}",
                daemon=True,  # a thread stuck past every bound must not keep the process alive
            )
            for i, fn in enumerate(fns)
        ]
        for t in threads:
            t.start()
        # Each thread's own waits are bounded; this bound catches a segment that never
        # reaches a yield point (a stuck kernel), with one timeout of slack per micro-batch.
        deadline = time.monotonic() + self.timeout_s * (self.num_ubatches + 1)
        for i, t in enumerate(threads):
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                with self._cond:
                    if self._error is None:
                        self._error = (i, TimeoutError("abandoned by the step"))
                    self._cond.notify_all()
                raise TimeoutError(
                    f"{self._who(i)} did not finish within {self.timeout_s:g}s per micro-batch "
                    f"(last events: {self.events[-4:]})"
                )
        if self._error is not None:
            ubatch, exc = self._error
            exc.add_note(f"(raised in {self._who(ubatch)} of a dual-batch-overlap step)")
            raise exc
        return results


# (runner, micro-batch index) of the current thread; unset outside DBO threads.
_current: contextvars.ContextVar[tuple[DualBatchRunner, int] | None] = contextvars.ContextVar(
    "tokenwise_dbo_ubatch", default=None
)


def dbo_current_ubatch() -> int | None:
    """The index of the DBO micro-batch the caller runs as (None outside DBO threads)."""
    current = _current.get()
    return None if current is None else current[1]


def dbo_yield(detail: str = "") -> None:
    """A yield point: let the other micro-batch compute. A no-op outside DBO threads."""
    current = _current.get()
    if current is not None:
        runner, ubatch = current
        runner.yield_turn(ubatch, detail)


def dbo_record(kind: str, detail: str = "") -> None:
    """Add an event to the current micro-batch's trace (a no-op outside DBO threads)."""
    current = _current.get()
    if current is not None:
        runner, ubatch = current
        runner.record(ubatch, kind, detail)


def wait_collective(work: Any, issued_at: float, what: str, on_cpu: bool = True) -> None:
    """Wait for an async collective, bounded, then honour the injected latency.

    `work` is what `torch.distributed` returned for `async_op=True`; `issued_at` the
    `time.perf_counter()` when it was issued. On CPU (gloo) the wait has the DBO bound and its
    error names the collective and the micro-batch, so a rank that never joins shows up as an
    error instead of a hang. On a GPU (`on_cpu=False`) a bounded NCCL wait would block the
    host until the kernel finishes, so the wait only orders the stream and NCCL's own watchdog
    (the DP group's timeout) is the bound (unverified here: no GPU).
    """
    current = _current.get()
    timeout = dbo_timeout_s() if current is None else current[0].timeout_s
    dbo_record("wait", what)
    try:
        if on_cpu:
            work.wait(timeout=timedelta(seconds=timeout))
        else:
            work.wait()
    except RuntimeError as exc:
        who = "the step" if current is None else current[0]._who(current[1])
        raise TimeoutError(
            f"{what} of {who} failed or did not complete within {timeout:g}s ({exc}); is "
            "every DP rank running the same step?"
        ) from exc
    delay = collective_delay_s()
    if delay:
        left = issued_at + delay - time.perf_counter()
        if left > 0:
            time.sleep(left)  # releases the GIL
