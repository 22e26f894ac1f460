"""What one step hands from the scheduler to the runner, and from the runner back.

Its own module so that the scheduler (which consumes the runner's output in
`update_from_output`) and the runner (which consumes the scheduler's output) import neither
each other nor the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from tokenwise.engine.request import Request
from tokenwise.kv_cache.managers import StateStep
from tokenwise.sampling.sampler import LogprobsTensors


@dataclass
class ScheduledRequest:
    """One request's part of a step, and how its block tables changed since its last step.

    The block manager owns the tables; the runner keeps a mirror of them in its input batch
    and updates it from two fields per KV-cache group (index = group, `block_manager.SELF_ATTN`
    first): `num_blocks`, the table's length after this step's allocation, and `new_block_ids`,
    the blocks that end it which the runner has not seen (appended since the request last ran,
    or the whole table for a request new to the runner). A table that was cut back
    (`BlockManager.truncate`) shows as `num_blocks` below the mirror's length. A model without
    a KV cache has no groups: both are empty.
    """

    request: Request
    num_new_tokens: int
    # Encoder-decoder models: the encoder tokens this step runs for the request (its whole
    # encoder, in the step that admits it; 0 otherwise). They count against the token budget.
    num_encoder_tokens: int = 0
    new_block_ids: tuple[list[int], ...] = ()
    num_blocks: tuple[int, ...] = ()
    # Speculative decoding: the draft tokens this step verifies after the request's last
    # token. They are the last `len(spec_token_ids)` of `num_new_tokens`.
    spec_token_ids: list[int] = field(default_factory=list)
    # Recurrent-state models: start the live state from a snapshot (or zeros) before the
    # step, snapshot it after (`kv_cache.managers.StateStep`); None when neither.
    state_step: StateStep | None = None

    @property
    def completes_sequence(self) -> bool:
        """True when this step computes the sequence's last known token (so it samples)."""
        req = self.request
        computed = req.num_computed_tokens + self.num_new_tokens - len(self.spec_token_ids)
        return computed == req.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_preempted: int = 0
    # Requests aborted because they can never be placed, each with the reason why.
    aborted: list[tuple[Request, str]] = field(default_factory=list)
    # Requests that left the running set (finished, aborted or preempted) since the last
    # step: the runner frees their input-batch rows.
    finished_req_ids: list[str] = field(default_factory=list)

    @property
    def total_num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def unschedule(self, req: Request) -> int:
        """Take `req`'s entry out of the step (a preemption under the priority policy may hit
        a request scheduled earlier in it); the token budget it had taken (0 if none)."""
        for i, item in enumerate(self.scheduled):
            if item.request is req:
                del self.scheduled[i]
                return item.num_new_tokens + item.num_encoder_tokens
        return 0


@dataclass
class ScoredPromptTokens:
    """The prompt-token logprobs a step computed (`SamplingParams.prompt_logprobs`).

    `requests[k] = (request, first, count)`: the next `count` rows of `logprobs` score that
    request's prompt tokens `first .. first + count - 1`, each given the tokens before it.
    Column 0 of a row is the prompt token itself, then the row's top-N (`LogprobsTensors`).
    """

    requests: list[tuple[Request, int, int]]
    logprobs: LogprobsTensors


@dataclass
class ModelRunnerOutput:
    """One entry per sampled request, in the order of `sampled_requests`.

    `sampled_token_ids[i]` holds the tokens request i emits this step: one, or with
    speculative decoding its accepted drafts followed by one drawn token. `logprobs`, when
    asked for, has one row per emitted token, request after request in that order.

    An embedding model's step samples nothing: row `i` of `pooler_output` (`[n, hidden]`,
    float32) is the embedding of `pooled_requests[i]`.
    """

    sampled_requests: list[ScheduledRequest]
    sampled_token_ids: list[list[int]]
    logprobs: LogprobsTensors | None
    num_tokens: int
    pooled_requests: list[ScheduledRequest] = field(default_factory=list)
    pooler_output: torch.Tensor | None = None
    # Prompt-token logprobs computed this step (a prompt chunk's), for the requests asking.
    prompt_logprobs: ScoredPromptTokens | None = None
    # EAGLE: the target features this step computed, per request
    # (`tokenwise.runner.target_hidden.TargetHidden`); None unless an EAGLE head proposes.
    target_hidden: Any = None
