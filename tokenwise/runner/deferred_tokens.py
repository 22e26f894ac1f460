"""Async scheduling on a GPU: a step's sampled ids come back by a non-blocking copy.

Without this, the runner reads the sampled ids with `.tolist()` at the end of each pass: the
worker thread waits there for the GPU to finish the whole step, so step N+1 is launched only
once step N is done and copied, and the GPU idles while the host prepares N+1. Under async
scheduling (`engine/async_step.py`) nothing on the host needs step N's ids before its output
is processed, except step N+1's input, and that can be fed on the device. So, here:

- the sampled ids are copied into a pinned host buffer with `non_blocking=True` on the compute
  stream, and an event is recorded after the copy (`PendingTokens`);
- the runner's copy of each request gets a placeholder (`PLACEHOLDER`) where the token goes,
  so its counts stay right for the next step's `prepare`;
- the next step's input ids at those positions are written on the device from the sampled
  tensor itself (`patch_inputs`: one index copy, ordered on the stream after the sampling);
- the engine thread waits for the event (bounded, `WAIT_TIMEOUT_S`) only when it applies the
  step's output (`ModelRunnerOutput.pending_token_ids`), and the runner writes the real ids
  into its copies as soon as they have arrived (`fill`), before anything reads them from the
  host (a recomputation, a step that is not plain greedy);
- the step's inputs are copied to the device from pinned buffers that the next step rewrites:
  with no blocking read left at the end of a step, the runner records an event once a step's
  input copies are queued (`inputs_queued`) and the next step waits for it (bounded) before
  it writes them, as vLLM's runner does; those copies run first in the step, so the wait is
  short.

Only plain greedy steps take this path (`eligible`): sampling that reads the request's past
tokens on the host (penalties, bad_words) or returns logprobs would need the ids first. The CPU
path is untouched (a CPU "copy" is the tensor itself). Unverified on a GPU so far:
benchmarks/gpu_check.py's async part (gpu_check_parts/streams.py) times it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tokenwise.engine.step_outputs import ScheduledRequest
from tokenwise.runner.request_states import CachedRequestState
from tokenwise.runner.sample_step import greedy_ids, sample_step
from tokenwise.sampling.params import SamplingParams
from tokenwise.sampling.sampler import Sampler

# A placeholder in the runner's copy of a request, where a token in flight goes.
PLACEHOLDER = -1
# A step's copy lands in milliseconds; one not there after this is a hung or lost device.
WAIT_TIMEOUT_S = 60.0
_POLL_S = 20e-6


def _wait_event(event: Any, timeout_s: float, what: str) -> None:
    """Poll `event` until done; `TimeoutError` naming `what` after `timeout_s` seconds (a
    CUDA event's own `synchronize()` has no bound)."""
    deadline = time.monotonic() + timeout_s
    while not event.query():
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{what} within {timeout_s:g} s of their launch: the device is hung or far behind"
            )
        time.sleep(_POLL_S)


class PendingTokens:
    """One step's sampled ids (one per sampled request) on their way to the host."""

    def __init__(self, device_ids: torch.Tensor, event: Any) -> None:
        """Start the copy of `device_ids` (one id per request) on the current stream, then
        record `event` (a `torch.cuda.Event`, or anything with `record()` and `query()`)."""
        self.device_ids = device_ids = device_ids.reshape(-1)
        pin = device_ids.device.type == "cuda"
        self.host = torch.empty(device_ids.shape, dtype=device_ids.dtype, pin_memory=pin)
        self.host.copy_(device_ids, non_blocking=True)
        self.event = event
        event.record()
        self._ids: list[int] | None = None

    def ready(self) -> bool:
        """Whether the copy has landed (never waits)."""
        return self._ids is not None or bool(self.event.query())

    def wait(self, timeout_s: float = WAIT_TIMEOUT_S) -> list[int]:
        """The ids, once the copy has landed; `TimeoutError` after `timeout_s` seconds."""
        if self._ids is None:
            _wait_event(self.event, timeout_s, "a step's sampled token ids did not reach the host")
            self._ids = self.host.tolist()
        return self._ids

    def token_lists(self, timeout_s: float = WAIT_TIMEOUT_S) -> list[list[int]]:
        """`ModelRunnerOutput.sampled_token_ids`: one token per sampled request."""
        return [[t] for t in self.wait(timeout_s)]


@dataclass
class _InFlight:
    pending: PendingTokens
    # Each sampled request's state and where its placeholder sits in `all_token_ids` and
    # `output_token_ids`, in the order of the sampled ids.
    slots: list[tuple[CachedRequestState, int, int]]


def eligible(params: list[SamplingParams]) -> bool:
    """Whether a step's sampling reads nothing the host must know first: plain greedy rows
    (`Sampler.is_plain_greedy`: no penalties, no logprobs) without `bad_words`."""
    return Sampler.is_plain_greedy(params) and not any(p.bad_words for p in params)


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    """`values` as an int64 index on `device`, without a host sync: a copy from pageable memory
    would wait for the stream, so on a GPU the values go through a pinned buffer."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=torch.int64, device=device)
    pinned = torch.tensor(values, dtype=torch.int64).pin_memory()
    return pinned.to(device, non_blocking=True)


class DeferredTokens:
    """The runner's sampled ids still on their way to the host; used on the worker thread.

    `rows` is the runner's `InputBatch` (its `req_index` and `token_ids`): a row that cached a
    placeholder gets the real id too, for a later step that reads that position again.
    `make_event` makes the events after the sampled ids' copies, `inputs_event` (default: the
    same) those after a step's input copies."""

    def __init__(
        self,
        make_event: Callable[[], Any],
        rows: Any,
        inputs_event: Callable[[], Any] | None = None,
    ) -> None:
        self.make_event = make_event
        self.inputs_event = inputs_event or make_event
        self.rows = rows
        self._in_flight: deque[_InFlight] = deque()
        self._inputs_copied: Any = None  # the event after the last step's input copies

    @classmethod
    def create(cls, config: Any, device: torch.device, tp_size: int, rows: Any) -> Any:
        """The runner's `DeferredTokens` on a CUDA device under async scheduling with one rank
        and no drafts; None elsewhere (the CPU path: every step reads its ids at once)."""
        if device.type != "cuda" or not config.scheduler.async_scheduling:
            return None
        if tp_size != 1 or config.parallel.pipeline_parallel_size != 1 or config.speculative:
            return None
        return cls(torch.cuda.Event, rows)

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def sample(
        self,
        sampler: Sampler,
        logits: torch.Tensor,
        sampled: list[ScheduledRequest],
        states: list[CachedRequestState],
        vocab_size: int,
    ) -> PendingTokens | None:
        """Sample a step's rows, its ids left on the device and their copy started: the
        `PendingTokens`. None, with every earlier id in place on the host, when the step is
        not `eligible` (the caller samples it as usual)."""
        params = [st.sampling_params for st in states]
        if any(s.spec_token_ids for s in sampled) or not eligible(params):
            self.fill(wait=True)
            return None
        return self.launch(greedy_ids(sampler, logits, states, vocab_size), states)

    def launch(self, device_ids: torch.Tensor, states: list[CachedRequestState]) -> PendingTokens:
        """Start the copy of a step's sampled ids (`device_ids[i]` is `states[i]`'s token) and
        put a placeholder for each in its request's copy."""
        pending = PendingTokens(device_ids, self.make_event())
        slots = []
        for state in states:
            state.append([PLACEHOLDER])
            slots.append((state, len(state.all_token_ids) - 1, len(state.output_token_ids) - 1))
        self._in_flight.append(_InFlight(pending, slots))
        return pending

    def inputs_queued(self) -> None:
        """A step's input copies (host to device) are queued: mark the point on the stream."""
        self._inputs_copied = self.inputs_event()
        self._inputs_copied.record()

    def fill(self, wait: bool, timeout_s: float = WAIT_TIMEOUT_S) -> None:
        """Before a step writes its inputs: wait (bounded) until the last step's input copies
        have run, then write the ids that have arrived into the requests' copies (and the batch
        rows that cached their placeholders), oldest step first; with `wait`, all of them
        (each wait bounded by `timeout_s`)."""
        if self._inputs_copied is not None:
            _wait_event(self._inputs_copied, timeout_s, "a step's input copies did not run")
            self._inputs_copied = None
        rows = self.rows
        while self._in_flight and (wait or self._in_flight[0].pending.ready()):
            done = self._in_flight.popleft()
            for (state, at_all, at_out), token in zip(
                done.slots, done.pending.wait(timeout_s), strict=True
            ):
                state.all_token_ids[at_all] = token
                state.output_token_ids[at_out] = token
                row = rows.req_index.get(state.req_id)
                if row is not None and rows.row_states[row] is state:
                    rows.token_ids[row, at_all] = token

    def patch_inputs(self, step: Any) -> int:
        """Write the ids still in flight into `step`'s flat `input_ids` on the device, where it
        reads a placeholder (`step`: the runner's `StepInputs`, whose request `i`,
        `step.states[i]`, reads `query_lens_np[i]` positions from `context_lens_np[i]`). The
        number of ids written."""
        if not self._in_flight:
            return 0
        row_of = {id(state): i for i, state in enumerate(step.states)}
        ctx, qlen = step.context_lens_np.tolist(), step.query_lens_np.tolist()
        starts = [0]
        for q in qlen:
            starts.append(starts[-1] + q)
        dst: list[int] = []
        src: list[torch.Tensor] = []
        for flight in self._in_flight:
            picks = []
            for k, (state, at_all, _) in enumerate(flight.slots):
                i = row_of.get(id(state))
                if i is None or not ctx[i] <= at_all < ctx[i] + qlen[i]:
                    continue
                dst.append(starts[i] + at_all - ctx[i])
                picks.append(k)
            if picks:
                ids = flight.pending.device_ids
                src.append(ids.index_select(0, _index(picks, ids.device)))
        if dst:
            input_ids = step.input_ids
            values = torch.cat(src).to(input_ids.dtype)
            input_ids.index_copy_(0, _index(dst, input_ids.device), values)
        return len(dst)


def sample_or_defer(
    deferred: DeferredTokens | None,
    sampler: Sampler,
    logits: torch.Tensor,
    sampled: list[ScheduledRequest],
    states: list[CachedRequestState],
    vocab_size: int,
    device: torch.device,
) -> tuple[list[list[int]], Any, PendingTokens | None]:
    """A step's sampling: `(token_ids, logprobs, None)` on the host as usual, or `([], None,
    pending)` when `deferred` leaves the ids on the device and their copy in flight."""
    if deferred is not None:
        pending = deferred.sample(sampler, logits, sampled, states, vocab_size)
        if pending is not None:
            return [], None, pending
    token_ids, logprobs = sample_step(sampler, logits, sampled, states, vocab_size, device)
    return token_ids, logprobs, None
