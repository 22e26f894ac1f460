"""Verify draft tokens against the target model: speculative (rejection) sampling.

A request that carried `k` draft tokens into a step gets `k + 1` rows of logits: row `j` is
the target's distribution for the token after draft `j - 1` (row 0: after the last verified
token). Walking its drafts in order, draft `d_j` is accepted with probability
`min(1, p_j(d_j) / q_j(d_j))`, where `p_j` is the target's distribution at row `j` after the
request's own sampling settings (penalties, temperature, min-p, top-k/top-p) and `q_j` the
proposer's (a point mass for n-gram lookup: `q_j(d_j) = 1`). At the first rejection the
request takes a token drawn from the residual `max(p_j - q_j, 0)` (renormalised) and stops;
when every draft is accepted it also takes a bonus token drawn from row `k`. This emits
between 1 and `k + 1` tokens per step whose joint distribution is exactly the target's
(Leviathan et al. 2023; Chen et al. 2023): speculation changes the speed, never the output
distribution. Greedy rows accept a draft iff it is the row's argmax, and replace it with the
argmax, so greedy output equals greedy decoding without drafts.

Everything is computed for all rows at once (acceptance tests, residual draws, bonus draws);
only the per-request scan for the first rejection is a Python loop, over short lists.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenwise.sampling.metadata import SamplingMetadata
from tokenwise.sampling.sampler import (
    LogprobsTensors,
    _argmax,
    apply_penalties,
    exponential_race,
    gather_logprobs,
    sampling_probs,
)


@dataclass
class VerifyOutput:
    """Per request: the tokens it emits this step (accepted drafts, then one drawn token)."""

    token_ids: list[list[int]]
    num_accepted: list[int]  # drafts accepted, per request (len(token_ids[i]) - 1)
    # Row-aligned with the emitted tokens: request i's m-th token is row `row_starts[i] + m`.
    logprobs: LogprobsTensors | None
    row_starts: list[int]


def verify(
    logits: torch.Tensor,
    draft_token_ids: list[list[int]],
    metadata: SamplingMetadata | None,
    draft_probs: torch.Tensor | None = None,
) -> VerifyOutput:
    """Accept or reject each request's drafts; `logits` has `len(drafts) + 1` rows per request.

    `metadata` describes every row (a request's settings repeated over its rows, with the
    drafts before each row counted as output tokens for the penalties); None means plain
    greedy rows without logprobs. `draft_probs` (`[num drafts, V]`, the proposer's distribution
    at each draft, in row order of the drafts) is None for point-mass proposers.
    """
    logits = logits.float()
    num_rows = logits.shape[0]
    starts, draft_rows, drafts = [], [], []
    row = 0
    for tokens in draft_token_ids:
        starts.append(row)
        draft_rows.extend(range(row, row + len(tokens)))
        drafts.extend(tokens)
        row += len(tokens) + 1
    if row != num_rows:
        raise ValueError(f"{num_rows} logit rows for drafts needing {row}")
    device = logits.device
    draft_idx = torch.tensor(draft_rows, dtype=torch.long, device=device)
    draft_tok = torch.tensor(drafts, dtype=torch.long, device=device)

    raw_logprobs = None
    if metadata is not None and metadata.max_num_logprobs is not None:
        raw_logprobs = torch.log_softmax(logits, dim=-1)
    if metadata is not None and not metadata.no_penalties:
        logits = apply_penalties(logits, metadata)

    # What each row emits if it is the row where the request stops: greedy rows their argmax,
    # random rows a draw from the residual (draft rows) or from the target itself (last rows).
    greedy_mask = None if metadata is None else metadata.greedy_mask
    all_greedy = metadata is None or metadata.all_greedy
    emitted = _argmax(logits)
    accepted = torch.zeros(num_rows, dtype=torch.bool, device=device)
    if draft_rows:
        accepted[draft_idx] = emitted[draft_idx] == draft_tok
    if not all_greedy:
        assert metadata is not None and greedy_mask is not None
        probs = sampling_probs(logits, metadata)
        uniform = _uniform(num_rows, metadata.generators, device)
        random_accept = torch.zeros_like(accepted)
        if draft_rows:
            p_draft = probs[draft_idx, draft_tok]
            q_draft = (
                torch.ones_like(p_draft)
                if draft_probs is None
                else draft_probs.float()[torch.arange(len(drafts), device=device), draft_tok]
            )
            random_accept[draft_idx] = uniform[draft_idx] * q_draft < p_draft
        residual = _residual(probs, draft_idx, draft_tok, draft_probs)
        drawn = exponential_race(residual, metadata.generators)
        emitted = torch.where(greedy_mask, emitted, drawn)
        accepted = torch.where(greedy_mask, accepted, random_accept)

    accepted_list = accepted.tolist()
    emitted_list = emitted.tolist()
    token_ids, num_accepted = [], []
    for start, tokens in zip(starts, draft_token_ids, strict=True):
        m = 0
        while m < len(tokens) and accepted_list[start + m]:
            m += 1
        token_ids.append([*tokens[:m], emitted_list[start + m]])
        num_accepted.append(m)

    out_logprobs = None
    if raw_logprobs is not None:
        assert metadata is not None and metadata.max_num_logprobs is not None
        # The token each row stands for: an accepted draft, or the row's own draw.
        per_row = emitted.clone()
        if draft_rows:
            per_row[draft_idx] = torch.where(accepted[draft_idx], draft_tok, emitted[draft_idx])
        out_logprobs = gather_logprobs(raw_logprobs, per_row, metadata.max_num_logprobs)
    return VerifyOutput(token_ids, num_accepted, out_logprobs, starts)


def _residual(
    probs: torch.Tensor,
    draft_idx: torch.Tensor,
    draft_tok: torch.Tensor,
    draft_probs: torch.Tensor | None,
) -> torch.Tensor:
    """What a row draws from if it is where its request stops: `max(p - q, 0)` on draft rows
    (unnormalised: the exponential race normalises), the target itself on the last rows."""
    residual = probs.clone()
    if draft_idx.numel():
        if draft_probs is None:  # q is a point mass on the draft
            residual[draft_idx, draft_tok] = 0.0
        else:
            residual[draft_idx] = (probs[draft_idx] - draft_probs.float()).clamp_(min=0.0)
    # A residual with no mass left (p <= q everywhere) cannot be reached: the draft was then
    # accepted with probability 1. Fall back to the target to keep the draw defined.
    empty = residual.sum(dim=-1) <= 0
    residual[empty] = probs[empty]
    return residual


def _uniform(
    num_rows: int, generators: dict[int, torch.Generator], device: torch.device
) -> torch.Tensor:
    """U[0, 1) per row; seeded rows draw from their request's generator."""
    u = torch.rand(num_rows, device=device)
    for row, gen in generators.items():
        u[row] = torch.rand(1, generator=gen, device=gen.device).item()
    return u


__all__ = ["VerifyOutput", "verify"]
