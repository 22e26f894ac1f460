"""Prompt-token logprobs (`SamplingParams.prompt_logprobs`), scored while the prompt prefills.

The hidden state at prompt position `p` predicts token `p + 1`, so a step that computes
positions `ctx .. ctx + q - 1` of a prompt of length `L` can score prompt tokens `ctx + 1 ..
min(ctx + q, L - 1)`. The runner adds those rows to the step's logit rows (after the sampling
rows, so tensor-parallel workers, which compute the same rows, join the same vocabulary
gather) and this module turns their logits into log-softmax, the token's own value and rank,
and the top-N, as vLLM reports them.

Chunked prefill scores each chunk's tokens in its own step. A request resumed after a
preemption recomputes its prompt, but only tokens past what the runner has scored for it
(`CachedRequestState.next_prompt_logprob`, which outlives the preemption) are scored, so none
is reported twice. Every position must be computed by the
request itself: the scheduler gives such requests no prefix-cache hits (a cached block keeps
K/V, not the hidden states these rows need).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenwise.engine.request import Request
from tokenwise.engine.step_outputs import ScoredPromptTokens
from tokenwise.runner.input_batch import StepInputs
from tokenwise.sampling.sampler import gather_logprobs


@dataclass
class PromptLogprobRows:
    """The rows a step scores: `flat_indices[k]` is the hidden row whose logits score prompt
    token `token_ids[k]`; `requests` as in `ScoredPromptTokens`."""

    requests: list[tuple[Request, int, int]]
    flat_indices: list[int]
    token_ids: list[int]
    num_logprobs: int  # the largest top-N among the requests


def plan_prompt_logprobs(step: StepInputs) -> PromptLogprobRows | None:
    """The prompt tokens this step can score for requests that ask (None: no such rows)."""
    states = step.states
    wanted = [
        i for i, state in enumerate(states) if state.next_prompt_logprob < state.num_prompt_tokens
    ]
    if not wanted:
        return None
    starts = np.cumsum(step.query_lens_np) - step.query_lens_np
    rows = PromptLogprobRows([], [], [], 0)
    for i in wanted:
        state = states[i]
        ctx, q = int(step.context_lens_np[i]), int(step.query_lens_np[i])
        first = max(ctx + 1, state.next_prompt_logprob)
        last = min(ctx + q, state.num_prompt_tokens - 1)
        if first > last:
            continue
        state.next_prompt_logprob = last + 1  # scored by this step
        req = step.scheduled[i].request  # the engine's handle: the scores go back to it
        rows.requests.append((req, first, last - first + 1))
        # Token t is scored by the hidden state of position t - 1, row (t - 1 - ctx) of the
        # request's query.
        base = int(starts[i]) - ctx - 1
        rows.flat_indices.extend(range(base + first, base + last + 1))
        rows.token_ids.extend(state.prompt_token_ids[first : last + 1])
        num = state.sampling_params.prompt_logprobs or 0
        rows.num_logprobs = max(rows.num_logprobs, num)
    return rows if rows.requests else None


def score_prompt_tokens(rows: PromptLogprobRows, logits: torch.Tensor) -> ScoredPromptTokens:
    """Log-softmax of the rows' raw logits (float32): each prompt token's logprob and rank,
    and the top-N."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    tokens = torch.tensor(rows.token_ids, dtype=torch.int64, device=logits.device)
    return ScoredPromptTokens(rows.requests, gather_logprobs(logprobs, tokens, rows.num_logprobs))


__all__ = ["PromptLogprobRows", "plan_prompt_logprobs", "score_prompt_tokens"]
