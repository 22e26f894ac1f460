"""Mask the logits of guided rows to the tokens their grammars allow: one batched op per step.

Each guided row's matcher writes its allowed set into one row of a packed bitmask (32 tokens
per int32 word, xgrammar's layout); the whole bitmask then goes to the logits' device and is
applied to every row at once. Unguided rows keep an all-ones row, so the apply needs no
gather or scatter. Logit columns beyond the grammar's vocabulary (a model whose embedding is
padded past its tokenizer) are never allowed: no grammar can account for them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xgrammar

from tokenwise.sampling.guided.state import GrammarState


def apply_grammar_bitmask(
    logits: torch.Tensor,
    grammars: Sequence[GrammarState | None],
    vocab_size: int | None = None,
    drafts: Sequence[list[int]] | None = None,
) -> None:
    """Set to -inf, in place, every logit a row's grammar forbids (rows with None: untouched).

    `vocab_size` is the vocabulary the grammars were compiled for (default: the logits' width).
    With `drafts` (speculative decoding), `grammars` and `drafts` are per request and request
    `i` owns `len(drafts[i]) + 1` consecutive rows: row `j` of them is masked as if the first
    `j` drafts had been accepted (`GrammarState.fill_draft_bitmasks`).
    """
    if drafts is None:
        drafts = [[] for _ in grammars]
    spans, start = [], 0
    for tokens in drafts:
        spans.append((start, len(tokens) + 1))
        start += len(tokens) + 1
    guided = [i for i, g in enumerate(grammars) if g is not None]
    if not guided:
        return
    width = logits.shape[-1]
    vocab = width if vocab_size is None else min(vocab_size, width)
    bitmask = xgrammar.allocate_token_bitmask(start, vocab)  # all ones: allow all
    rows = []
    for i in guided:
        grammar, (first, count) = grammars[i], spans[i]
        assert grammar is not None
        if count == 1:
            grammar.fill_bitmask(bitmask, first)
        else:
            grammar.fill_draft_bitmasks(bitmask, first, list(drafts[i]))
        rows.extend(range(first, first + count))
    bitmask = bitmask.to(logits.device, non_blocking=True)
    if vocab < width:
        logits[rows, vocab:] = float("-inf")
    xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=rows)
