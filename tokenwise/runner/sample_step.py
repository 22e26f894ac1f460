"""A step's logit rows to emitted tokens: per-row processing, then sampling or verification.

One row per sampling request, or, in a step with drafts, one row per draft position
(`spec_verify.verify_drafts`). Before a token is chosen, each row gets what its request asks
of its logits, in this order, the same on both paths: the `min_tokens` stop-token ban, the
per-request logits processors (`sampling/logits_processors.py`: logit_bias, allowed_token_ids,
bad_words), then the grammar mask of guided requests.
"""

from __future__ import annotations

import torch

from tokenwise.engine.step_outputs import ScheduledRequest
from tokenwise.runner.request_states import CachedRequestState
from tokenwise.runner.spec_verify import suppress_stop_tokens_before_min_tokens, verify_drafts
from tokenwise.sampling.guided.bitmask import apply_grammar_bitmask
from tokenwise.sampling.logits_processors import apply_logits_processors
from tokenwise.sampling.metadata import SamplingMetadata
from tokenwise.sampling.sampler import LogprobsTensors, Sampler


def sample_step(
    sampler: Sampler,
    logits: torch.Tensor,
    sampled: list[ScheduledRequest],
    states: list[CachedRequestState],
    vocab_size: int,
    device: torch.device,
) -> tuple[list[list[int]], LogprobsTensors | None]:
    """The tokens each of `sampled` emits this step (`logits` holds their rows; `states` are
    the runner's states of those requests), and the logprob rows of those tokens when any
    request asked for logprobs."""
    if any(s.spec_token_ids for s in sampled):
        return verify_drafts(logits, sampled, states, vocab_size, device)
    params = [st.sampling_params for st in states]
    if Sampler.is_plain_greedy(params):  # argmax only: no sampling metadata to build
        return _singles(greedy_ids(sampler, logits, states, vocab_size)), None
    _process_rows(logits, states, params, vocab_size)
    metadata = SamplingMetadata.from_params(
        params,
        [st.generator for st in states],
        output_token_ids=[st.output_token_ids for st in states],
        prompt_token_ids=[st.prompt_token_ids for st in states],
        vocab_size=logits.shape[-1],
        device=device,
    )
    out = sampler(logits, metadata)
    return _singles(out.sampled_token_ids), out.logprobs


def _process_rows(
    logits: torch.Tensor,
    states: list[CachedRequestState],
    params: list,
    vocab_size: int,
) -> None:
    """What each row's request asks of its logits before a token is chosen, in place."""
    suppress_stop_tokens_before_min_tokens(logits, states)
    apply_logits_processors(logits, params, lambda i: states[i].output_token_ids)
    # Guided rows: what their grammars forbid goes to -inf, one batched op for all rows.
    apply_grammar_bitmask(logits, [st.grammar for st in states], vocab_size)


def greedy_ids(
    sampler: Sampler, logits: torch.Tensor, states: list[CachedRequestState], vocab_size: int
) -> torch.Tensor:
    """Plain greedy rows (`Sampler.is_plain_greedy`) after their processing: each row's
    token id, left where the logits are (async scheduling on a GPU copies them itself)."""
    _process_rows(logits, states, [st.sampling_params for st in states], vocab_size)
    return sampler.greedy(logits).sampled_token_ids


def _singles(token_ids: torch.Tensor) -> list[list[int]]:
    """One emitted token per request (a step without drafts)."""
    return [[t] for t in token_ids.tolist()]


__all__ = ["greedy_ids", "sample_step"]
