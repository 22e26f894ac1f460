"""One record per engine step, kept in a bounded ring: what the server's engine view draws.

The Prometheus counters say how much work an engine did; they cannot say which requests shared
a step, how many prefill and decode tokens it ran, which graph its batch descriptor picked,
how long its forward pass took, or when a preemption hit. A `StepRecord` says exactly that for
one step, built from what the engine already has in hand (the scheduler's output, the runner's
graph choice, the block pool's counters), so it is always on: `benchmarks/step_records_cost.py`
measured ~4 us per step of one request, ~11 us for 32, ~70 us for 256 (the split is one pass
over the step's requests), plus ~2.3 us to carry the record from a core to the front end; a
decode step of the built-in model alone takes 1-3 ms.

Memory is bounded: `StepRecords` keeps the last `capacity` records (`TOKENWISE_STEP_RECORDS`,
default 2048; a record holds ~350 bytes) and counts every record it was ever given,
so a reader that polls with a cursor (`since`) learns when it fell behind and how many it
missed. An engine-core process sends each step's record to its client with the step's outputs
(`core_messages.CoreOutputs.steps`); the client keeps its own ring of every rank's records.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenwise import envs

if TYPE_CHECKING:
    from tokenwise.engine.block_pool import BlockPool
    from tokenwise.engine.stats import EngineStats
    from tokenwise.engine.step_outputs import ScheduledRequest, SchedulerOutput

ENV_CAPACITY = "TOKENWISE_STEP_RECORDS"
DEFAULT_CAPACITY = 2048
# KV block states as `BlockPool.block_states` writes them, one byte per block.
KV_FREE, KV_CACHED, KV_USED = 0, 1, 2


def capacity_from_env() -> int:
    raw = envs.get(ENV_CAPACITY)
    try:
        capacity = int(raw)
    except ValueError:
        raise ValueError(f"{ENV_CAPACITY} must be a whole number of steps, got {raw!r}") from None
    if capacity < 1:
        raise ValueError(f"{ENV_CAPACITY} must be >= 1, got {capacity}")
    return capacity


@dataclass(slots=True)
class StepRecord:
    """What one engine step did. Token counts are the tokens the forward pass ran (prefix-cache
    hits are not run, so not counted); queue and KV figures are as the step left them."""

    seq: int  # this rank's step number (counts recorded steps from 0)
    rank: int  # data-parallel rank (0 without DP)
    time: float  # wall clock (time.time()) at the step's end
    num_reqs: int  # requests in the forward pass
    prefill_tokens: int  # prompt tokens (and recomputed ones after a preemption)
    decode_tokens: int  # one per decoding request, plus the drafts it verifies
    num_prefills: int  # requests among num_reqs that ran prompt tokens
    forward_ms: float  # the runner's execute_model (forward pass and sampling)
    step_ms: float  # the whole step: scheduling, forward, detokenizing, outputs
    graph_mode: str  # CUDA graph replayed: NONE, PIECEWISE or FULL
    # The batch descriptor the graph was picked by (padded token count, requests, uniform
    # decode, LoRA) and, for a uniform batch, each request's query length (1: decode; 1 + k:
    # verifying k drafts); None when the pass ran eagerly.
    descriptor: dict[str, Any] | None
    num_running: int
    num_waiting: int
    kv_used: int  # blocks held by requests
    kv_cached: int  # free blocks that still hold prefix-cache contents
    kv_free: int  # free blocks with nothing cached
    preempted: int  # requests preempted by this step's scheduling
    aborted: int  # requests aborted since the previous record (by a client or unplaceable)
    finished: int  # requests whose final output this step produced
    spec_draft_tokens: int = 0  # drafts verified this step (speculative decoding)
    spec_accepted_tokens: int = 0
    dummy: bool = False  # a DP rank's pass with no requests, joining its peers' collectives
    failed: bool = False  # the forward pass raised; its requests were failed


def split_step_tokens(scheduled: Iterable[ScheduledRequest]) -> tuple[int, int, int]:
    """(prefill tokens, decode tokens, prefilling requests) of a step, before it runs.

    A request decodes when it has output and its one new token is its last sampled one (plus
    drafts); anything else (a prompt chunk, a recompute after preemption) is a prefill. Read
    before the pass: `update_from_output` moves `num_computed_tokens`.
    """
    prefill = decode = prefills = 0
    for item in scheduled:
        req = item.request
        n = item.num_new_tokens
        if (
            n - len(item.spec_token_ids) == 1
            and req.num_output_tokens
            and req.num_computed_tokens == req.num_tokens - 1
        ):
            decode += n
        else:
            prefill += n
            prefills += 1
    return prefill, decode, prefills


class StepRecords:
    """A thread-safe ring of the last `capacity` records, read by cursor.

    The cursor is the number of records ever added: `since(cursor)` returns the records added
    after that point that are still held, and the cursor to ask with next time.
    """

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = capacity_from_env() if capacity is None else capacity
        if self.capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {self.capacity}")
        self._ring: deque[StepRecord] = deque(maxlen=self.capacity)
        self._lock = threading.Lock()
        self.total = 0  # records ever added

    def __len__(self) -> int:
        return len(self._ring)

    def append(self, record: StepRecord) -> None:
        with self._lock:
            self._ring.append(record)
            self.total += 1

    def extend(self, records: list[StepRecord]) -> None:
        if records:
            with self._lock:
                self._ring.extend(records)
                self.total += len(records)

    def since(self, cursor: int) -> tuple[list[StepRecord], int, int]:
        """(records added at or after `cursor` still held, the next cursor, records missed:
        added after `cursor` but already pushed out of the ring)."""
        with self._lock:
            first = self.total - len(self._ring)  # cursor of the oldest record held
            start = max(cursor, first)
            if start >= self.total:
                return [], self.total, max(0, first - cursor)
            skip = start - first
            items = list(self._ring)[skip:] if skip else list(self._ring)
            return items, self.total, max(0, first - cursor)


class StepRecorder:
    """Builds the engine's `StepRecord`s: `begin` before the forward pass (the token split),
    `forward_done` after it, `end` once the step's outputs are made. Records of steps that ran
    nothing are kept only when they carry an event (an abort or a preemption)."""

    def __init__(self, rank: int = 0, capacity: int | None = None) -> None:
        self.rank = rank
        self.records = StepRecords(capacity)
        self.num_aborted = 0  # aborts since the last record (the engine counts them here)
        self._seq = 0
        self._started = 0.0
        self._forward_start = 0.0
        self._forward_ms = 0.0
        self._split = (0, 0, 0)
        self._failed = False
        self._spec = (0, 0)
        self._stats: EngineStats | None = None

    def begin(self, sched: SchedulerOutput, started: float, stats: EngineStats) -> None:
        """Before the forward pass; `started`: perf_counter() when the step began."""
        self._started = started
        self._stats = stats  # the engine's, updated in place: speculative decoding's counters
        self._spec = (stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens)
        self._split = split_step_tokens(sched.scheduled)
        self._forward_ms = 0.0
        self._failed = False
        self._forward_start = time.perf_counter()

    def forward_done(self, failed: bool = False) -> None:
        self._forward_ms = (time.perf_counter() - self._forward_start) * 1000.0
        self._failed = failed

    def end(self, engine: Any, sched: SchedulerOutput, outputs: list[Any]) -> None:
        """After the step's outputs are made: the record, from the `LLMEngine`'s scheduler,
        block pool and runner (its graph choice; typed Any: the engine loop sits above)."""
        aborted = self.num_aborted + len(sched.aborted)
        num_finished = sum(out.finished for out in outputs)
        if sched.is_empty and not aborted and not sched.num_preempted and not num_finished:
            return
        mode, desc = getattr(engine.runner, "last_graph", (None, None))
        prefill, decode, prefills = self._split
        pool = engine.block_manager.pool
        stats = self._stats
        now = time.perf_counter()
        self.records.append(
            StepRecord(
                self._seq,
                self.rank,
                time.time(),
                len(sched.scheduled),
                prefill,
                decode,
                prefills,
                self._forward_ms,
                (now - self._started) * 1000.0,
                mode.name if mode is not None else "NONE",
                _descriptor(desc, getattr(engine.runner, "last_query_len", None)),
                len(engine.scheduler.running),
                len(engine.scheduler.waiting),
                pool.num_used,
                pool.num_free_cached,
                pool.num_free - pool.num_free_cached,
                sched.num_preempted,
                aborted,
                num_finished,
                stats.spec_decode_num_draft_tokens - self._spec[0],
                stats.spec_decode_num_accepted_tokens - self._spec[1],
                failed=self._failed,
            )
        )
        self._seq += 1
        self.num_aborted = 0

    def dummy(self, started: float, pool: BlockPool) -> None:
        """A DP rank's dummy pass (nothing to run while a peer did), begun at `started`."""
        forward_ms = (time.perf_counter() - started) * 1000.0
        free_cached = pool.num_free_cached
        self.records.append(
            StepRecord(
                self._seq,
                self.rank,
                time.time(),
                0,
                0,
                0,
                0,
                forward_ms,
                forward_ms,
                "NONE",
                None,
                0,
                0,
                pool.num_used,
                free_cached,
                pool.num_free - free_cached,
                0,
                0,
                0,
                dummy=True,
            )
        )
        self._seq += 1


def _descriptor(desc: Any, query_len: int | None) -> dict[str, Any] | None:
    """A step's batch descriptor as a dict, with the query length every request of a uniform
    batch ran (the runner's `last_query_len`: 1 for decode, 1 + k for verifying k drafts; the
    descriptor's `num_reqs` is rounded down, and plain FULL mode's keys drop it); None for an
    eager pass."""
    if desc is None:
        return None
    return {**desc._asdict(), "query_len": query_len or None}
