"""Prompt-token logprobs (`SamplingParams.prompt_logprobs`), scored while the prompt prefills.

The hidden state at prompt position `p` predicts token `p + 1`, so a step that computes
positions `ctx .. ctx + q - 1` of a prompt of length `L` can score prompt tokens `ctx + 1 ..
min(ctx + q, L - 1)`. The runner adds those rows to the step's logit rows (after the sampling
rows, so tensor-parallel workers, which compute the same rows, join the same vocabulary
gather) and this module turns their logits into log-softmax, the token's own value and rank,
and the top-N, as vLLM reports them.

Chunked prefill scores each chunk's tokens in its own step. A request resumed after a
preemption recomputes its prompt, but only tokens past what its `Request.prompt_logprobs`
already holds are scored, so none is reported twice. Every position must be computed by the
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
    wanted = [
        i
        for i, item in enumerate(step.scheduled)
        if item.request.prompt_logprobs is not None
        and len(item.request.prompt_logprobs) < item.request.num_prompt_tokens
    ]
    if not wanted:
        return None
    starts = np.cumsum(step.query_lens_np) - step.query_lens_np
    rows = PromptLogprobRows([], [], [], 0)
    for i in wanted:
        req = step.scheduled[i].request
        ctx, q = int(step.context_lens_np[i]), int(step.query_lens_np[i])
        assert req.prompt_logprobs is not None
        first = max(ctx + 1, len(req.prompt_logprobs))
        last = min(ctx + q, req.num_prompt_tokens - 1)
        if first > last:
            continue
        rows.requests.append((req, first, last - first + 1))
        # Token t is scored by the hidden state of position t - 1, row (t - 1 - ctx) of the
        # request's query.
        base = int(starts[i]) - ctx - 1
        rows.flat_indices.extend(range(base + first, base + last + 1))
        rows.token_ids.extend(req.prompt_token_ids[first : last + 1])
        num = req.sampling_params.prompt_logprobs or 0
        rows.num_logprobs = max(rows.num_logprobs, num)
    return rows if rows.requests else None


def score_prompt_tokens(rows: PromptLogprobRows, logits: torch.Tensor) -> ScoredPromptTokens:
    """Log-softmax of the rows' raw logits (float32): each prompt token's logprob and rank,
    and the top-N."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    tokens = torch.tensor(rows.token_ids, dtype=torch.int64, device=logits.device)
    return ScoredPromptTokens(rows.requests, gather_logprobs(logprobs, tokens, rows.num_logprobs))


__all__ = ["PromptLogprobRows", "plan_prompt_logprobs", "score_prompt_tokens"]
