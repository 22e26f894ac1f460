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

The same layout lets a verification batch replay a FULL graph (CUDA, or a CPU graph) on any
device: the graph was captured over decode rows, and the backend's forward writes every new key
and value before it attends. `graph_query_len` says whether a step is one: a uniform batch
(every request verifying exactly `k` drafts) or, for proposers whose draft counts vary from
step to step (suffix decoding, the per-request draft budget), any batch of decode and verify
rows, which replays the decode graph of its token count. `write_decode_rows` writes its rows
into the input batch's own buffers, which the graph reads. A verifying step then costs a
replayed decode step of `1 + d` rows (the C GEMV streams each weight once for all of them)
instead of an eager forward: on the Qwen3-0.6B shape in fp32, eager verification of one
draft cost 1.32x a replayed decode step (`benchmarks/spec_forced.py --costs` compares both).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import torch

from tokenwise.config import CUDAGraphMode, SpeculativeConfig
from tokenwise.distributed.step_message import GroupTables
from tokenwise.runner.input_batch import InputBatch, StepInputs

# Queries this long or shorter, after a context, are verification-sized.
MAX_VERIFY_QUERY = 16
# Proposers that run beside the target and leave its graphs alone (EAGLE and MTP read the
# target's hidden states, which they need from an eager forward).
GRAPH_VERIFY_METHODS = ("ngram", "suffix", "draft_model")


def is_verify_step(step: StepInputs) -> bool:
    """A step that verifies drafts, of decodes and short queries after a context only.

    Other steps keep the attention path they always had (a TP worker's copy of a step knows
    no drafts: it takes the usual path, which computes the same attention)."""
    if not step.num_reqs or not any(s.spec_token_ids for s in step.scheduled):
        return False
    q, ctx = step.query_lens_np, step.context_lens_np
    longer = q > 1
    return bool(longer.any()) and int(q.max()) <= MAX_VERIFY_QUERY and bool(ctx[longer].all())


def graph_verify_len(spec: SpeculativeConfig | None, plain_decoder: bool) -> int | None:
    """1 + k when uniform verification batches get FULL graphs of their own, else None.

    For proposers that run beside the target, whose graphs they leave alone
    (`GRAPH_VERIFY_METHODS`), over plain causal decoder attention (the layers whose
    verification rows are decode rows).
    """
    if spec is None or spec.method not in GRAPH_VERIFY_METHODS or not plain_decoder:
        return None
    return 1 + spec.num_speculative_tokens


def uniform_query_len(step: StepInputs, verify_query_len: int | None) -> int:
    """The query length every request of `step` runs, when its batch is uniform for graphs: 1
    (pure decode), `verify_query_len` (1 + k: every request verifies exactly k drafts), else 0.

    A request's drafts are the last tokens of its query, so a query of 1 + k tokens holding k
    drafts is one decode token plus its drafts (never a prompt chunk of the same length).
    """
    if not step.num_reqs:
        return 0
    if int(step.query_lens_np.max()) == 1:
        return 1
    if verify_query_len is None or len(step.scheduled) != step.num_reqs:
        return 0
    k = verify_query_len - 1
    if all(
        s.num_new_tokens == verify_query_len and len(s.spec_token_ids) == k for s in step.scheduled
    ):
        return verify_query_len
    return 0


def graph_query_len(step: StepInputs, verify_query_len: int | None) -> tuple[int, int]:
    """How a step may replay a FULL graph: (its query length for the step record, the query
    length to dispatch it with), (0, 0) when it is not uniform for graphs.

    A uniform batch is `(q, q)` (`uniform_query_len`). With verify graphs on
    (`verify_query_len` set), any other step whose requests each run one token plus their
    drafts, some with drafts, is `(longest query, 1)`: laid out as one decode row per query
    token (`write_decode_rows`) it is a decode batch of `num_tokens` rows, and replays the
    decode graph of that size (padded). The draft budget and suffix decoding vary the draft
    count per step and per request, so without this most verifying steps would run eagerly.
    """
    q = uniform_query_len(step, verify_query_len)
    if q:
        return q, q
    if verify_query_len is None or not step.num_reqs or len(step.scheduled) != step.num_reqs:
        return 0, 0
    longest = 1
    for s in step.scheduled:
        if s.num_new_tokens != 1 + len(s.spec_token_ids):
            return 0, 0
        longest = max(longest, s.num_new_tokens)
    return (longest, 1) if longest > 1 else (0, 0)


def _row_layout(step: StepInputs) -> tuple[np.ndarray, np.ndarray]:
    """Each query token's request (index in the step) and the context before it."""
    q = step.query_lens_np
    owner = np.repeat(np.arange(step.num_reqs), q)
    starts = np.cumsum(q) - q
    offset = np.arange(step.num_tokens) - np.repeat(starts, q)
    return owner, step.context_lens_np[owner] + offset


def _real_rows(step: StepInputs, owner: np.ndarray) -> np.ndarray:
    """The batch row of each real query token: `rows` names real requests only (none in a TP
    worker's copy), and a padded step's padding rows come after them."""
    return step.rows[owner[owner < len(step.rows)]]


def write_decode_rows(batch: InputBatch, step: StepInputs) -> StepInputs:
    """`step` as one decode row per query token, written into `batch`'s own buffers.

    For a FULL graph: it reads the sequence lengths and block tables of its rows from those
    buffers (the per-token inputs and slot mapping are already there). Row `i` of a request
    gets its block table and `context + i + 1` keys. Call before `InputBatch.pad`.
    """
    owner, context = _row_layout(step)
    t = step.num_tokens
    if t > batch.max_num_reqs:
        raise ValueError(f"{t} decode rows exceed the input batch's {batch.max_num_reqs} rows")
    width = step.block_tables.shape[1]
    tables = batch.block_tables.np
    tables[:t, :width] = tables[owner, :width]  # fancy indexing copies before the write
    batch.seq_lens.np[:t] = context + 1
    return replace(
        step,
        num_reqs=t,
        seq_lens=batch.seq_lens.copy_to_device(t),
        block_tables=batch.block_tables.copy_to_device(t, width=width),
        rows=_real_rows(step, owner),
        query_lens_np=np.ones(t, dtype=np.int64),
        context_lens_np=context,
    )


def as_decode_rows(step: StepInputs, tables: GroupTables) -> tuple[StepInputs, GroupTables]:
    """`step` with one decode row per query token; each group's table repeated per row."""
    owner, context = _row_layout(step)
    ones = np.ones(step.num_tokens, dtype=np.int64)
    index = torch.from_numpy(owner).to(step.block_tables.device)
    rows: GroupTables = {}
    for group, (table, first, slots) in tables.items():
        row_first = None if first is None else [first[i] for i in owner.tolist()]
        rows[group] = (table.index_select(0, index), row_first, slots)
    seq_lens = torch.from_numpy((context + 1).astype(np.int32)).to(step.seq_lens.device)
    expanded = StepInputs(
        num_reqs=step.num_tokens,
        num_tokens=step.num_tokens,
        input_ids=step.input_ids,
        positions=step.positions,
        slot_mapping=step.slot_mapping,
        seq_lens=seq_lens,
        block_tables=rows[next(iter(rows))][0] if rows else step.block_tables,
        rows=_real_rows(step, owner),
        query_lens_np=ones,
        context_lens_np=context,
        logits_indices=step.logits_indices,
        sampled=step.sampled,
        scheduled=step.scheduled,
    )
    return expanded, rows


__all__ = [
    "MAX_VERIFY_QUERY",
    "GRAPH_VERIFY_METHODS",
    "as_decode_rows",
    "graph_query_len",
    "graph_verify_len",
    "is_verify_step",
    "uniform_query_len",
    "write_decode_rows",
]


def plan_graph(
    graph_runner: Any, batch: InputBatch, step: StepInputs, has_lora: bool, verify_len: int | None
) -> tuple[StepInputs, CUDAGraphMode, Any, int]:
    """How `graph_runner` runs `step`: `(step laid out for it, mode, batch descriptor, query
    length for the step record)`. A FULL graph over verifying rows reads them as decode rows
    (`write_decode_rows`); any graph pads the step to its descriptor's token count."""
    query_len, plan_len = graph_query_len(step, verify_len)
    mode, desc = graph_runner.plan(step.num_tokens, bool(plan_len), has_lora, plan_len)
    if mode == CUDAGraphMode.FULL and query_len > 1:
        step = write_decode_rows(batch, step)  # the graph's rows
    if mode != CUDAGraphMode.NONE:
        step = batch.pad(step, desc.num_tokens)
    return step, mode, desc, query_len
