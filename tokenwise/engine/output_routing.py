"""A forward pass's sampled tokens, their text and logprobs onto their requests.

Apart from the engine loop because it is a group of pure per-row bookkeeping with no say in the
loop's flow. The scheduler calls `detokenize_token` for each sampled token before it appends it
(the stop strings it completes feed the stop rules); after the scheduler has appended the
tokens and applied the stop rules, what is left is to record, per request, the tokens it kept since its last output and their logprob
entries (vLLM's `Logprob`, decoded when a tokenizer is loaded), and the prompt-token logprobs
scored while it prefilled. The engine passes in what it owns (its groups, its tokenizer, its
counters); nothing here keeps state.
"""

from __future__ import annotations

import time
from typing import Any

from tokenwise.engine.request import Request
from tokenwise.engine.stats import EngineStats
from tokenwise.engine.step_outputs import ModelRunnerOutput, ScoredPromptTokens
from tokenwise.engine.stop_rules import hides_token
from tokenwise.outputs import Logprob


def detokenize_token(req: Request, token: int) -> str | None:
    """Feed one sampled token to its request's detokenizer, before the scheduler appends it.

    Returns the stop string the token completed, if any, for the scheduler's stop rules. As
    in vLLM, a stop token ends the text without appearing in it, so such a token is not
    detokenized (`stop_rules.hides_token`).
    """
    if req.detokenizer is None or hides_token(req, token):
        return None
    return req.detokenizer.add_token(token)


def route_samples(
    sampled: list[tuple[Request, int]],
    result: ModelRunnerOutput,
    touched: dict[str, list[Request]],
    groups: dict[str, list[Request]],
    tokenizer: Any,
    stats: EngineStats,
) -> None:
    """Record each kept token (and its logprobs) on its request, for the next output.

    `sampled` pairs each request with how many of its emitted tokens it kept (a stop cuts
    the rest); logprob rows follow the emitted tokens, request after request. Each request's
    group goes into `touched` (by the caller's request id), so the step reports it.
    """
    now = time.monotonic()
    lp = result.logprobs
    lp_ids = lp.token_ids.tolist() if lp is not None else None
    lp_vals = lp.logprobs.tolist() if lp is not None else None
    lp_ranks = lp.ranks.tolist() if lp is not None else None
    row = 0
    for (req, kept), tokens in zip(sampled, result.sampled_token_ids, strict=True):
        touched[req.group_id] = groups[req.group_id]
        if req.first_token_time is None:
            req.first_token_time = now
        num_logprobs = req.sampling_params.logprobs
        for offset, token in enumerate(tokens[:kept]):
            req.new_token_ids.append(token)
            if num_logprobs is not None and lp_ids is not None:
                r = row + offset
                entry = logprob_entry(token, num_logprobs, lp_ids[r], lp_vals[r], tokenizer)
                entry[token].rank = lp_ranks[r]
                req.new_logprobs.append(entry)
                req.cumulative_logprob += lp_vals[r][0]
        stats.generation_tokens_total += kept
        row += len(tokens)


def route_prompt_logprobs(scored: ScoredPromptTokens, tokenizer: Any) -> None:
    """Append a step's prompt-token logprobs to their requests' lists, in prompt order.

    Only a token right after a list's end is taken, so a prompt scored again (it cannot
    be: the runner scores only past the end) would still not be reported twice.
    """
    lp = scored.logprobs
    ids, values, ranks = lp.token_ids.tolist(), lp.logprobs.tolist(), lp.ranks.tolist()
    row = 0
    for req, first, count in scored.requests:
        entries = req.prompt_logprobs
        num = req.sampling_params.prompt_logprobs or 0
        for k in range(count):
            if entries is not None and first + k == len(entries):
                token = req.prompt_token_ids[first + k]
                entry = logprob_entry(token, num, ids[row + k], values[row + k], tokenizer)
                entry[token].rank = ranks[row + k]
                entries.append(entry)
        row += count


def logprob_entry(
    token: int, num: int, ids: list[int], values: list[float], tokenizer: Any
) -> dict[int, Logprob]:
    """The sampled token (column 0) plus the top-`num` tokens, decoded when possible."""
    entry = {token: Logprob(values[0])}
    for j in range(1, num + 1):
        entry.setdefault(ids[j], Logprob(values[j], j))
    if tokenizer is not None:
        for tid, value in entry.items():
            value.decoded_token = tokenizer.decode([tid])
    return entry
