"""The engine loop under pipeline parallelism: up to P micro-batches in flight, one per
virtual engine, so that every stage has work.

Each `step()` visits the next virtual engine in turn. If it has no batch in flight, its own
scheduler schedules one and the runner submits it (stage 0 computes it and sends it on without
waiting). Then, when P batches are in flight, or nothing new was submitted, the oldest batch is
collected: the last stage's logits are sampled and its virtual engine's scheduler takes the
tokens, exactly as a one-stage step would. In steady state a step submits batch k + 1 and then
collects batch k, so stage 0 computes k + 1 while the later stages compute k. A virtual engine
is scheduled again only after its previous batch was collected (its requests' next tokens are
not known before), and its requests never leave it, so each request's outputs come in order.

Aborts of a request whose batch is in flight wait until that batch is collected: the batch is
still writing the request's K/V into blocks an abort would free.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from tokenwise.engine.request import Request, RequestStatus
from tokenwise.engine.scheduler import Scheduler
from tokenwise.engine.step_outputs import SchedulerOutput
from tokenwise.runner.pipeline_stages import PipelineStages


class PipelineLoop:
    def __init__(self, engine: Any, pipeline: PipelineStages, schedulers: list[Scheduler]) -> None:
        """`engine`: the `LLMEngine` whose outputs and statistics the steps produce (typed
        Any: the engine loop sits above this module)."""
        self.engine = engine
        self.pipeline = pipeline  # the driver runner's pipeline part
        self.schedulers = schedulers
        self.size = len(schedulers)
        self._next = 0
        # Submitted, not yet collected: (virtual engine, its step, when it was scheduled).
        self._in_flight: deque[tuple[int, SchedulerOutput, float]] = deque()
        self._pending_finish: list[tuple[list[Request], RequestStatus]] = []

    def busy_engines(self) -> set[int]:
        return {engine for engine, _, _ in self._in_flight}

    def finish_when_idle(self, samples: list[Request], status: RequestStatus) -> None:
        """Finish `samples` now if their virtual engine has nothing in flight, else once its
        batch is collected."""
        if samples[0].virtual_engine in self.busy_engines():
            self._pending_finish.append((samples, status))
        else:
            self.schedulers[samples[0].virtual_engine].finish_requests(samples, status)

    def _finish_pending(self) -> None:
        busy = self.busy_engines()
        keep = []
        for samples, status in self._pending_finish:
            if samples[0].virtual_engine in busy:
                keep.append((samples, status))
            else:
                self.schedulers[samples[0].virtual_engine].finish_requests(samples, status)
        self._pending_finish = keep

    def step(self) -> list[Any]:
        engine = self.engine
        started = time.perf_counter()
        touched: dict[str, list[Request]] = {}
        virtual_engine = self._next
        self._next = (virtual_engine + 1) % self.size
        submitted = False
        scheduled = SchedulerOutput()
        if virtual_engine not in self.busy_engines():
            scheduled = self.schedulers[virtual_engine].schedule()
            engine.warn_aborted(scheduled)
            if not scheduled.is_empty:
                self.pipeline.submit(scheduled, virtual_engine)
                self._in_flight.append((virtual_engine, scheduled, started))
                submitted = True
        # A step's record describes the batch it collected (each batch is recorded once), or
        # only the events of its scheduling when it collected none.
        recorded = SchedulerOutput(num_preempted=scheduled.num_preempted, aborted=scheduled.aborted)
        engine.step_recorder.begin(recorded, started, engine._stats)
        if self._in_flight and (len(self._in_flight) == self.size or not submitted):
            _, done, scheduled_at = self._in_flight.popleft()
            engine.step_recorder.begin(done, scheduled_at, engine._stats)
            _, result = self.pipeline.collect()
            engine.step_recorder.forward_done()
            engine.apply_result(done, result, touched)
            self._finish_pending()
            recorded = done
        elif not submitted:
            engine.wait_for_grammars()
        return engine.end_step(recorded, touched, scheduled.num_preempted)
