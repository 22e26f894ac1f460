"""Per-request logits processors: `logit_bias`, `allowed_token_ids` and `bad_words`.

They change one request's logits before its token is chosen, so they must act the same
wherever a request's logit rows are made: the runner's ordinary step (one row per request) and
speculative verification (one row per draft position, `runner/spec_verify.py`), or drafts would
be accepted that decoding without them could never produce. Both call `apply_logits_processors`
on their rows, in place, after the `min_tokens` ban and before the grammar mask and the sampler.

Each processor is one batched tensor operation over the rows that use it; the only Python loops
are over those rows' own settings (their bias entries, their bad words). A step where no row
uses any costs one attribute check per row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from tokenwise.sampling.params import SamplingParams


def apply_logits_processors(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    past_tokens: Callable[[int], Sequence[int]],
) -> None:
    """Apply row `i`'s processors (`params[i]`) to `logits[i]`, in place.

    `past_tokens(i)` is what row `i`'s request has generated before that row's token (for a
    draft row, its accepted output plus the drafts before the row); `bad_words` reads it.
    Bias comes first, so a banned or disallowed token stays at -inf whatever its bias.
    """
    # `has_logits_processors`, inlined: this runs for every row of every step.
    rows = [i for i, p in enumerate(params) if p.logit_bias or p.allowed_token_ids or p.bad_words]
    if not rows:
        return
    _add_logit_bias(logits, [(i, params[i].logit_bias) for i in rows if params[i].logit_bias])
    _keep_allowed(
        logits, [(i, params[i].allowed_token_ids) for i in rows if params[i].allowed_token_ids]
    )
    banned: list[tuple[int, int]] = []
    for i in rows:
        sequences = params[i].bad_words_token_ids
        if sequences:
            banned += [(i, token) for token in banned_tokens(sequences, past_tokens(i))]
    _mask(logits, banned)


def banned_tokens(sequences: list[list[int]], past: Sequence[int]) -> list[int]:
    """The last token of each bad sequence whose other tokens end `past` (all one-token ones)."""
    out = []
    for seq in sequences:
        prefix = len(seq) - 1
        if prefix == 0 or (len(past) >= prefix and list(past[len(past) - prefix :]) == seq[:-1]):
            out.append(seq[-1])
    return out


def _index(pairs: list[tuple[int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.tensor([r for r, _ in pairs], dtype=torch.int64, device=device)
    cols = torch.tensor([c for _, c in pairs], dtype=torch.int64, device=device)
    return rows, cols


def _add_logit_bias(logits: torch.Tensor, biased: list[tuple[int, dict[int, float]]]) -> None:
    if not biased:
        return
    pairs = [(i, token) for i, bias in biased for token in bias]
    values = [value for _, bias in biased for value in bias.values()]
    bias = torch.tensor(values, dtype=logits.dtype, device=logits.device)
    logits.index_put_(_index(pairs, logits.device), bias, accumulate=True)


def _keep_allowed(logits: torch.Tensor, allowed: list[tuple[int, list[int]]]) -> None:
    """Every token but the allowed ones to -inf, for all restricted rows at once."""
    if not allowed:
        return
    rows = torch.tensor([i for i, _ in allowed], dtype=torch.int64, device=logits.device)
    drop = torch.ones((len(allowed), logits.shape[-1]), dtype=torch.bool, device=logits.device)
    pairs = [(k, token) for k, (_, tokens) in enumerate(allowed) for token in tokens]
    drop[_index(pairs, logits.device)] = False
    logits[rows] = logits[rows].masked_fill(drop, float("-inf"))


def _mask(logits: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    if pairs:
        logits[_index(pairs, logits.device)] = float("-inf")


__all__ = ["apply_logits_processors", "banned_tokens"]
