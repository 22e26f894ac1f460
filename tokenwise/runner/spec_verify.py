"""Per-row logits processing for a step's sampled requests, and verification of their drafts.

A request that verifies `k` speculative drafts owns `k + 1` logit rows (`InputBatch.prepare`
picks them). Everything row-wise that the runner does before sampling — the `min_tokens`
stop-token ban, the per-request logits processors (`sample_step.py` applies the same ones to
a step without drafts), the grammar mask, the sampling metadata — is built per row here, and
`rejection.verify` decides which drafts each request keeps.
"""

from __future__ import annotations

import torch

from tokenwise.engine.step_outputs import ScheduledRequest
from tokenwise.engine.stop_rules import tokens_banned_before_min_tokens
from tokenwise.runner.request_states import CachedRequestState
from tokenwise.sampling.guided.bitmask import apply_grammar_bitmask
from tokenwise.sampling.logits_processors import apply_logits_processors
from tokenwise.sampling.metadata import SamplingMetadata
from tokenwise.sampling.rejection import verify
from tokenwise.sampling.sampler import LogprobsTensors, Sampler


def suppress_stop_tokens_before_min_tokens(
    logits: torch.Tensor, rows: list[CachedRequestState]
) -> None:
    """`min_tokens`: until a request has that many outputs, its stop rules' tokens are banned.

    `rows[i]` is the request that logit row `i` belongs to."""
    for row, state in enumerate(rows):
        banned = tokens_banned_before_min_tokens(state)
        if banned:
            logits[row, banned] = float("-inf")


def verify_drafts(
    logits: torch.Tensor,
    sampled: list[ScheduledRequest],
    states: list[CachedRequestState],
    vocab_size: int,
    device: torch.device,
) -> tuple[list[list[int]], LogprobsTensors | None]:
    """The tokens each request emits in a step with drafts, and their logprob rows
    (`states[i]`: the runner's state of `sampled[i]`).

    Each row is sampled with its request's settings; the drafts before a row count as output
    tokens there, so penalties see what the request will have written by then. The engine
    proposes no drafts before `min_tokens` is reached, so the stop-token ban only ever touches single-row requests; a guided request's row j is
    masked as its grammar stands after its first j drafts.
    """
    rows = [
        st for s, st in zip(sampled, states, strict=True) for _ in range(len(s.spec_token_ids) + 1)
    ]
    suppress_stop_tokens_before_min_tokens(logits, rows)
    # Row j of a request follows its first j drafts: they count as generated for bad_words.
    drafts_before = [j for s in sampled for j in range(len(s.spec_token_ids) + 1)]
    drafts_of_row = [s.spec_token_ids for s in sampled for _ in range(len(s.spec_token_ids) + 1)]
    apply_logits_processors(
        logits,
        [st.sampling_params for st in rows],
        lambda i: rows[i].output_token_ids + drafts_of_row[i][: drafts_before[i]],
    )
    apply_grammar_bitmask(
        logits,
        [st.grammar for st in states],
        vocab_size,
        [s.spec_token_ids for s in sampled],
    )
    params = [st.sampling_params for st in rows]
    metadata = None
    if not Sampler.is_plain_greedy(params):
        metadata = SamplingMetadata.from_params(
            params,
            [st.generator for st in rows],
            output_token_ids=[
                st.output_token_ids + s.spec_token_ids[:j]
                for s, st in zip(sampled, states, strict=True)
                for j in range(len(s.spec_token_ids) + 1)
            ],
            prompt_token_ids=[st.prompt_token_ids for st in rows],
            vocab_size=logits.shape[-1],
            device=device,
        )
    out = verify(logits, [s.spec_token_ids for s in sampled], metadata)
    logprobs = out.logprobs
    if logprobs is not None:  # keep the rows of the emitted tokens only
        keep = [
            start + m
            for start, tokens in zip(out.row_starts, out.token_ids, strict=True)
            for m in range(len(tokens))
        ]
        index = torch.tensor(keep, dtype=torch.int64, device=logprobs.token_ids.device)
        logprobs = LogprobsTensors(
            logprobs.token_ids.index_select(0, index),
            logprobs.logprobs.index_select(0, index),
            logprobs.ranks.index_select(0, index),
        )
    return out.token_ids, logprobs


__all__ = ["suppress_stop_tokens_before_min_tokens", "verify_drafts"]
