"""The scheduler one step ahead of the runner: placeholders for the tokens still in flight.

Under async scheduling (`async_step.py`) step N+1 is scheduled while step N runs, before its
sampled tokens are known. So the scheduler counts a step's tokens as computed when it
schedules them (not when the pass returns), and a step that completes a request's known
tokens leaves one placeholder on it (`Request.num_output_placeholders`): the token that step
will sample. The next step then schedules the request's decode over that placeholder; only
the runner knows the token's id, and it feeds it from its own copy of the request
(`runner/request_states.py`), to which it appended step N's token before step N+1 runs (one
worker runs the steps in order). Each `ScheduledRequest.num_tokens` therefore counts the
placeholders too: it is the runner's count, checked against its copy.

When step N's output comes back, each token fills a placeholder, is detokenized and checked
against the stop rules as in a synchronous step. A request that finished at step N (or was
aborted) may already be in step N+1: that step's token for it is discarded (it keeps 0
tokens, nothing is streamed) and its blocks were freed when it finished; the steps run in
order on one worker, so a later step that reuses them writes after step N+1 did. A request is
not scheduled over a placeholder that must end it (`max_tokens`, `max_model_len`): no wasted
decode for a request that is done. A request preempted with a token in flight keeps its
placeholder and its blocks go at once; the token is appended when it arrives, and only then is
the request admitted again, to recompute prompt and output together.

What the scheduler cannot follow one step ahead is refused: recurrent state snapshots are
committed per applied step (`async_step.check_async_engine`), and a guided-decoding grammar
advances on each known token before the next step's mask (refused per request, here).
"""

from __future__ import annotations

from typing import Any

from tokenwise.config import SchedulerConfig
from tokenwise.engine.request import Request, RequestStatus
from tokenwise.engine.step_apply import apply_forward_pass
from tokenwise.engine.step_outputs import ModelRunnerOutput, SchedulerOutput


class AsyncSchedulerMixin:
    """Mixed in before a kind's scheduler class (`async_scheduler_cls`); overrides the
    places where a step's tokens meet the request's counts."""

    max_model_len: int
    block_manager: Any

    def add_request(self, request: Request) -> None:
        if request.grammar is not None:
            raise ValueError(
                "structured outputs (guided decoding) do not run with async_scheduling=True "
                "yet: the grammar must see step N's token before step N+1's mask; start the "
                "engine without --async-scheduling to use them"
            )
        super().add_request(request)  # type: ignore[misc]

    def limit_chunk(self, request: Request, num_computed: int, num_new: int) -> int:
        num_new = super().limit_chunk(request, num_computed, num_new)  # type: ignore[misc]
        pending = request.num_output_placeholders
        if pending and num_new > 0:
            if request.status is not RequestStatus.RUNNING:
                # Preempted with its token in flight: it is admitted again once the token is
                # known (the runner's copy has it already; the recomputation must too).
                return 0
            max_tokens = request.sampling_params.max_tokens
            if max_tokens is not None and request.num_output_tokens + pending >= max_tokens:
                return 0  # the token in flight is its last
            if request.num_tokens + pending >= self.max_model_len:
                return 0
        return num_new

    def schedule(self) -> SchedulerOutput:
        out: SchedulerOutput = super().schedule()  # type: ignore[misc]
        for item in out.scheduled:
            req = item.request
            item.num_tokens += req.num_output_placeholders  # the runner's count
            req.num_computed_tokens += item.num_new_tokens
            if item.completes_sequence:
                req.num_output_placeholders += 1
        return out

    def update_from_output(
        self,
        scheduler_output: SchedulerOutput,
        runner_output: ModelRunnerOutput,
        on_token: Any = None,
    ) -> list[tuple[Request, int]]:
        self.block_manager.commit_step()
        sampled, finished = apply_forward_pass(
            scheduler_output, runner_output, on_token, self.max_model_len, scheduled_ahead=True
        )
        for status, reqs in finished.items():
            self.finish_requests(reqs, status)  # type: ignore[attr-defined]
        return sampled


def async_scheduler_cls(base: type) -> type:
    """`base` (a kind's scheduler class) scheduling one step ahead."""
    return type(f"Async{base.__name__}", (AsyncSchedulerMixin, base), {})


def scheduler_class(base: type, config: SchedulerConfig) -> type:
    """The scheduler class the engine builds: `base`, one step ahead under async scheduling."""
    return async_scheduler_cls(base) if config.async_scheduling else base
