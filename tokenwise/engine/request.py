"""One sample of a request as the scheduler sees it: its tokens, progress and status.

The scheduler is its one writer (and the drafter, which leaves its proposals on it). The runner
keeps its own copy of what it needs (`NewRequestData`, sent once; the generator of a seeded
request is the runner's), and what the engine reports lives in the output processor
(`output_processor.SampleOutput`). A caller's request with `n > 1` becomes n of these (siblings
with the same `group_id`). It carries no blocks: the block manager owns every block table. It
carries no kind's fields either: embedding and encoder-decoder requests subclass it
(`kinds/requests.py`).
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from tokenwise.lora.request import LoRARequest
from tokenwise.sampling.guided.state import GrammarState
from tokenwise.sampling.params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Its prefix hit is being read back from the KV tier (`kv_cache/tier_loads.py`).
    WAITING_FOR_REMOTE_KVS = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self.value >= RequestStatus.FINISHED_STOPPED.value

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


_SEQ = itertools.count()


@dataclass(eq=False)
class Request:
    """One sequence being generated. `n > 1` requests are split into one Request per sample.

    `num_computed_tokens` counts tokens whose K/V is in the cache; the next step computes
    `all_token_ids[num_computed_tokens:]` (or a chunk of it). A preempted request drops its
    cache and recomputes prompt + output so far, keeping what it generated.

    `arrival_time` is set when the engine accepts it (the time of its first token is the output
    processor's).

    `priority` orders the waiting queue under the "priority" scheduling policy (lower first,
    then `arrival_time`, then `seq`: the order requests were made in, which keeps the samples
    of one request, which share an arrival time, in order).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    seq: int = field(default_factory=lambda: next(_SEQ))
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit tokens at first admission; -1 = not yet
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    # Speculative decoding: draft tokens proposed for the request's next step (the engine's
    # proposer writes them after a step; the scheduler takes them into the next one).
    spec_token_ids: list[int] = field(default_factory=list)
    # Async scheduling: tokens scheduled to be sampled by steps still in flight, whose ids
    # only the runner knows yet (`engine/async_scheduler.py`; always 0 otherwise).
    num_output_placeholders: int = 0
    # Guided decoding: the matcher the scheduler advances (None for unguided requests).
    grammar: GrammarState | None = None
    # Why the request ended with FINISHED_ERROR (its grammar, or a failed forward pass).
    error: str | None = None
    # Pipeline parallelism: the virtual engine (scheduler, KV cache slice) it lives on, always.
    virtual_engine: int = 0
    # The caller's request id (shared by the samples of an `n > 1` request; defaults to
    # `request_id`): siblings are placed together (pipeline virtual engines).
    group_id: str = ""

    def __post_init__(self) -> None:
        if not self.group_id:
            self.group_id = self.request_id
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def runner_inputs(self) -> dict[str, Any]:
        """A model kind's extras the runner keeps for the request (`NewRequestData`)."""
        return {}

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished
