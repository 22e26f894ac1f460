"""What the runner keeps of each request it runs: its own copy, owned here, not shared.

The scheduler sends a request's settings once, in the first step that schedules it
(`NewRequestData`: prompt, sampling parameters, LoRA, the grammar that masks its logits, a
kind's inputs); from then on the runner appends the tokens it samples itself, and each step's
entry says only how many tokens the request has (`ScheduledRequest.num_tokens`), which is
checked against this copy so a step the runner did not see is an error, not wrong tokens.
The state outlives a preemption (the request's batch row goes; its tokens, generator and
prompt-logprob progress stay) and goes when the request finishes (`finished_req_ids`).

The generator of a seeded request lives here: the runner is what draws from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenwise.engine.step_outputs import NewRequestData, ScheduledRequest, SchedulerOutput


@dataclass(eq=False)
class CachedRequestState(NewRequestData):
    """One request as the runner sees it: what the scheduler sent once (`NewRequestData`'s
    fields, under the names the sampling code reads), plus what the runner adds."""

    generator: torch.Generator | None = None
    all_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    # The next prompt token whose logprob to score (token 0 has none); the prompt's length
    # once all are scored, or when none were asked for.
    next_prompt_logprob: int = 0

    @classmethod
    def create(cls, new: NewRequestData) -> CachedRequestState:
        params = new.sampling_params
        seed = params.seed
        state = cls(
            new.req_id,
            list(new.prompt_token_ids),
            params,
            tuple(new.eos_token_ids),
            new.lora_request,
            new.grammar,
            dict(new.kind_inputs),
            torch.Generator().manual_seed(seed) if seed is not None else None,
        )
        state.all_token_ids = list(new.prompt_token_ids)
        wants = params.prompt_logprobs is not None
        state.next_prompt_logprob = 1 if wants else len(new.prompt_token_ids)
        return state

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)


class RequestStates:
    """The runner's requests by id: made from `new_request`, dropped when they finish."""

    def __init__(self) -> None:
        self.by_id: dict[str, CachedRequestState] = {}

    def __len__(self) -> int:
        return len(self.by_id)

    def update(self, scheduler_output: SchedulerOutput) -> None:
        """Take in the step's new requests and forget the finished ones."""
        by_id = self.by_id
        for rid in scheduler_output.finished_req_ids:
            by_id.pop(rid, None)
        for item in scheduler_output.scheduled:
            if item.new_request is not None:
                by_id[item.req_id] = CachedRequestState.create(item.new_request)

    def record(self, states: list[CachedRequestState], token_ids: list[list[int]]) -> None:
        """Append what each sampling request emitted this step (accepted drafts included)."""
        for state, tokens in zip(states, token_ids, strict=True):
            state.append(tokens)


def state_mismatch(item: ScheduledRequest, state: CachedRequestState | None) -> RuntimeError:
    """The error for a step entry whose request the runner has no state for, or whose token
    count differs from the runner's copy (raised by `InputBatch.prepare`)."""
    if state is None:
        return RuntimeError(
            f"request {item.req_id}: the runner has no state for it (its first step carried "
            "no new_request, or it finished before)"
        )
    return RuntimeError(
        f"request {item.req_id}: the runner holds {len(state.all_token_ids)} tokens but the "
        f"scheduler counts {item.num_tokens}; a step's sampled tokens were not recorded"
    )
