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
from tokenwise.lora.request import LoRARequest
from tokenwise.sampling.guided.state import GrammarState
from tokenwise.sampling.params import SamplingParams
from tokenwise.sampling.sampler import LogprobsTensors


@dataclass
class NewRequestData:
    """What the runner keeps of a request, sent once: in the first step that schedules it.

    The runner makes its own state from it (`runner/request_states.py`) and from then on
    appends the tokens it samples. `grammar` is the source of the request's logits mask (the
    scheduler advances it as tokens are accepted); `kind_inputs` are a model kind's extras
    (`Request.runner_inputs`: pooling settings, encoder inputs, images).
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    lora_request: LoRARequest | None = None
    grammar: GrammarState | None = None
    kind_inputs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, req: Request) -> NewRequestData:
        return cls(
            req.request_id,
            req.prompt_token_ids,
            req.sampling_params,
            req.eos_token_ids,
            req.lora_request,
            req.grammar,
            req.runner_inputs(),
        )


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

    The runner reads the data fields only: `req_id` and the counts (`num_computed_tokens`,
    `num_tokens`, `num_preemptions`) are the request's when the step was scheduled, and `new_request` carries its
    settings in the first step that schedules it. `request` is the engine's own handle, which
    the runner hands back in its output and never reads.
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
    new_request: NewRequestData | None = None
    req_id: str = ""
    num_computed_tokens: int = 0
    num_tokens: int = 0
    num_preemptions: int = 0  # EAGLE's target features are kept per preemption generation

    def __post_init__(self) -> None:
        req = self.request
        self.req_id = req.request_id
        self.num_computed_tokens = req.num_computed_tokens
        self.num_tokens = req.num_tokens
        self.num_preemptions = req.num_preemptions

    @property
    def completes_sequence(self) -> bool:
        """True when this step computes the sequence's last known token (so it samples)."""
        computed = self.num_computed_tokens + self.num_new_tokens - len(self.spec_token_ids)
        return computed == self.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_preempted: int = 0
    # Requests aborted because they can never be placed, each with the reason why.
    aborted: list[tuple[Request, str]] = field(default_factory=list)
    # Requests that left the running set since the last step: finished or aborted (the
    # runner forgets them) and preempted (the runner frees their batch rows, keeps their state).
    finished_req_ids: list[str] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)

    def send_new_requests(self, known: set[str]) -> None:
        """Give each entry whose request the runner has not been sent yet its `new_request`,
        once (`known`: the ids sent so far; the scheduler drops an id when the request
        finishes). Called as the step is handed over, after any entry was taken out again."""
        for item in self.scheduled:
            if item.req_id not in known:
                known.add(item.req_id)
                item.new_request = NewRequestData.of(item.request)

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
    # Async scheduling on a GPU: the sampled ids still on their way to the host
    # (`runner.deferred_tokens.PendingTokens`); `sampled_token_ids` is empty until then.
    pending_token_ids: Any = None
