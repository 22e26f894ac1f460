"""The engine loop under async scheduling: step N+1 is scheduled while step N runs.

vLLM's `--async-scheduling`. In a synchronous step the cores that run the forward pass wait
while the scheduler places the next step and the output processor detokenizes, checks stops
and streams; here the forward passes run on one worker thread, in order, and the engine's
thread does that work meanwhile. The scheduler runs one step ahead with a placeholder for
each token in flight (`async_scheduler.py`); the runner fills the real token ids from its own
copy of the requests, so nobody waits for them.

Each `step()` schedules the next step and submits it, then, once two steps are in flight (or
nothing new was submitted), collects the older one and applies its output (detokenize, stop
rules, the requests' outputs) while the newer one runs. The first step of a burst therefore
returns no outputs; every later one returns the outputs of the step before. When no request
is left unfinished, the steps still in flight are collected (their tokens are discarded), so
an idle engine has nothing running behind a caller's back (a weight update, sleep).

The forward pass releases the interpreter lock inside its kernels, so the Python work of the
engine's thread overlaps the pass. On CPU both compete for the cores: whether leaving one core
to the engine's thread pays is measured in `benchmarks/async_scheduling.py`
(docs/scheduling.md: on 2 cores it does not pay).

A failed pass fails the requests of the steps in flight (the one behind it was scheduled on
its tokens), then the engine serves on, as a synchronous step does.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections import deque
from typing import Any

from tokenwise.engine.request import Request, RequestStatus
from tokenwise.engine.step_outputs import SchedulerOutput

logger = logging.getLogger("tokenwise.engine")

# Steps in flight at most: the one running and the one scheduled behind it.
MAX_IN_FLIGHT = 2


def check_async_engine(engine: Any) -> None:
    """Refuse what is known only once the engine's parts exist (the feature table refuses the
    rest): a model with recurrent state commits its state snapshots per applied step."""
    if getattr(engine.block_manager, "has_recurrent_state", False):
        raise ValueError(
            "async_scheduling=True does not run models with recurrent state (Gated DeltaNet / "
            "Mamba layers) yet: their state snapshots are committed step by step; start the "
            "engine without --async-scheduling"
        )


class AsyncStepLoop:
    def __init__(self, engine: Any, max_failed_steps: int) -> None:
        """`engine`: the `LLMEngine` whose scheduler, executor and outputs the steps use
        (typed Any: it imports this module); `max_failed_steps`: its limit of failed passes
        in a row, past which `step` raises (the engine is broken)."""
        check_async_engine(engine)
        self.engine = engine
        self.max_failed_steps = max_failed_steps
        self._worker = concurrent.futures.ThreadPoolExecutor(1, "tokenwise-forward")
        # Submitted, not yet collected: (step, its forward pass, when it was scheduled).
        self._in_flight: deque[tuple[SchedulerOutput, concurrent.futures.Future, float]] = deque()

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def step(self) -> list[Any]:
        engine = self.engine
        started = time.perf_counter()
        touched: dict[str, list[Request]] = {}
        sched = engine.scheduler.schedule()
        engine.warn_aborted(sched)
        submitted = not sched.is_empty
        if submitted:
            future = self._worker.submit(engine.model_executor.execute_model, sched)
            self._in_flight.append((sched, future, started))
        # The record describes the step collected, or only this scheduling's events.
        recorded = SchedulerOutput(num_preempted=sched.num_preempted, aborted=sched.aborted)
        engine.step_recorder.begin(recorded, started, engine._stats)
        if self._in_flight and (len(self._in_flight) >= MAX_IN_FLIGHT or not submitted):
            recorded = self._collect(touched)
        elif not submitted:
            engine.wait_for_grammars()
        outputs = engine.end_step(recorded, touched, sched.num_preempted)
        if not engine.groups:  # every request reported finished: nothing may run behind
            self.drain()
        return outputs

    def _collect(self, touched: dict[str, list[Request]]) -> SchedulerOutput:
        """Wait for the oldest step in flight and apply its output; the step collected."""
        engine = self.engine
        done, future, scheduled_at = self._in_flight.popleft()
        engine.step_recorder.begin(done, scheduled_at, engine._stats)
        try:
            result = future.result()  # the pass itself is bounded as a synchronous one is
            if result.pending_token_ids is not None:  # a GPU's non-blocking copy (bounded)
                result.sampled_token_ids = result.pending_token_ids.token_lists()
        except Exception as exc:
            engine.step_recorder.forward_done(failed=True)
            self._fail([done], exc, touched)
            return done
        engine.step_recorder.forward_done()
        engine.apply_result(done, result, touched)
        return done

    def _fail(
        self, steps: list[SchedulerOutput], exc: Exception, touched: dict[str, list[Request]]
    ) -> None:
        """A pass failed: fail its requests and those of the steps behind it, which were
        scheduled on its tokens (their passes are waited for, and their outputs dropped)."""
        engine = self.engine
        while self._in_flight:
            behind, future, _ = self._in_flight.popleft()
            concurrent.futures.wait([future])
            steps.append(behind)
        reqs = list({id(s.request): s.request for step in steps for s in step.scheduled}.values())
        logger.error(
            "model execution failed (%s: %s); failing %d requests",
            type(exc).__name__,
            exc,
            len(reqs),
        )
        engine.scheduler.finish_requests(reqs, RequestStatus.FINISHED_ERROR, discard_cached=True)
        for req in reqs:
            req.num_output_placeholders = 0
            if req.group_id in engine.groups:  # not yet reported finished
                req.error = req.error or f"{type(exc).__name__}: {exc}"
                engine.output_processor.touch(req, touched)
        # The engine's count of failures in a row (reset by a step that runs).
        engine._consecutive_failed_steps += 1
        if engine._consecutive_failed_steps >= self.max_failed_steps:
            raise RuntimeError(
                f"{engine._consecutive_failed_steps} forward passes failed in a row; the "
                f"engine is unusable (last error: {type(exc).__name__}: {exc})"
            ) from exc

    def drain(self) -> None:
        """Collect every step still in flight (an idle engine runs nothing)."""
        while self._in_flight:
            self._collect({})

    def shutdown(self) -> None:
        self._worker.shutdown(wait=True, cancel_futures=True)


def make_async_loop(engine: Any, max_failed_steps: int) -> AsyncStepLoop | None:
    """The engine's async loop when `async_scheduling` is on, else None."""
    if not engine.config.scheduler.async_scheduling:
        return None
    return AsyncStepLoop(engine, max_failed_steps)
