"""A verification step's attention as decode rows: one row per query token (CPU).

A request verifying `k` drafts runs `k + 1` query tokens after its context. Causal attention
over them is the same as `k + 1` one-token decodes over the same block table, the i-th seeing
`context + i + 1` keys, once every new key and value is in the cache. The CPU decode kernel
(`paged_decode_step`) writes all of a step's new keys and values first and then attends row by
row in one call per layer, so a verification step runs through it instead of the prefill path
(per-sequence SDPA with a mask built per layer, a gather of the context's blocks, a separate
cache write): measured on the built-in model, that path made a 5-token verification step's
forward cost 2.5x a decode step's.

Only the attention metadata changes: the runner still samples one row per request and token.
"""

from __future__ import annotations

import numpy as np
import torch

from tokenwise.distributed.tp_channel import SpecTables
from tokenwise.runner.input_batch import StepInputs

# Queries this long or shorter, after a context, are verification-sized.
MAX_VERIFY_QUERY = 16


def is_verify_step(step: StepInputs) -> bool:
    """A step that verifies drafts, of decodes and short queries after a context only.

    Other steps keep the attention path they always had (a TP worker's copy of a step knows
    no drafts: it takes the usual path, which computes the same attention)."""
    if not step.num_reqs or not any(s.spec_token_ids for s in step.scheduled):
        return False
    q, ctx = step.query_lens_np, step.context_lens_np
    longer = q > 1
    return bool(longer.any()) and int(q.max()) <= MAX_VERIFY_QUERY and bool(ctx[longer].all())


def as_decode_rows(step: StepInputs, tables: SpecTables) -> tuple[StepInputs, SpecTables]:
    """`step` with one decode row per query token; each spec's table repeated per row."""
    q = step.query_lens_np
    owner = np.repeat(np.arange(step.num_reqs), q)
    starts = np.cumsum(q) - q
    offset = np.arange(step.num_tokens) - np.repeat(starts, q)
    context = step.context_lens_np[owner] + offset
    ones = np.ones(step.num_tokens, dtype=np.int64)
    index = torch.from_numpy(owner).to(step.block_tables.device)
    rows: SpecTables = {}
    for spec, (table, first) in tables.items():
        row_first = None if first is None else [first[i] for i in owner.tolist()]
        rows[spec] = (table.index_select(0, index), row_first)
    seq_lens = torch.from_numpy((context + 1).astype(np.int32)).to(step.seq_lens.device)
    expanded = StepInputs(
        num_reqs=step.num_tokens,
        num_tokens=step.num_tokens,
        input_ids=step.input_ids,
        positions=step.positions,
        slot_mapping=step.slot_mapping,
        seq_lens=seq_lens,
        block_tables=rows[next(iter(rows))][0] if rows else step.block_tables,
        rows=step.rows[owner] if len(step.rows) else step.rows,  # a TP worker's has none
        query_lens_np=ones,
        context_lens_np=context,
        logits_indices=step.logits_indices,
        sampled=step.sampled,
        scheduled=step.scheduled,
    )
    return expanded, rows


__all__ = ["MAX_VERIFY_QUERY", "as_decode_rows", "is_verify_step"]
