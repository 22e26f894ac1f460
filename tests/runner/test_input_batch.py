"""The persistent input batch gives exactly the inputs and metadata the per-step builder gives.

The seed's list-based builder (`ListMetadataBuilder`, the test oracle) and the engine's
`InputBatch.prepare` + `CommonMetadataBuilder.prepare/build` are fed the same steps of a random simulation:
requests arrive, prefill in chunks, decode, grow new blocks, finish, are preempted and come back
(which must give them a fresh row), with and without a sliding window. Every tensor and host
field the backends read must be equal, step after step.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tests._states import states_of
from tests.attention._metadata_oracle import ListMetadataBuilder
from tokenwise.attention.metadata import CommonMetadataBuilder
from tokenwise.engine.request import Request
from tokenwise.engine.step_outputs import ScheduledRequest
from tokenwise.runner.input_batch import InputBatch
from tokenwise.sampling.params import SamplingParams

B = 4
MAX_LEN = 64
MAX_REQS = 6


def reference(
    items: list[ScheduledRequest], window: int | None, tables: dict[str, list[int]]
) -> tuple:
    builder = ListMetadataBuilder(B, window)
    ids, pos, seq_lens, query_lens = [], [], [], []
    for i, item in enumerate(items):
        req, n = item.request, item.num_new_tokens
        start = req.num_computed_tokens
        ids += req.all_token_ids[start : start + n]
        pos += range(start, start + n)
        seq_lens.append(start + n)
        query_lens.append(n)
        builder.add_sequence(i, start, n, tables[req.request_id])
    return builder.build(seq_lens, query_lens), ids, pos


def assert_same(
    batch: InputBatch,
    items: list[ScheduledRequest],
    window: int | None,
    tables: dict[str, list[int]],
) -> None:
    want, ids, pos = reference(items, window, tables)
    step = batch.prepare(items, states_of(items))
    tables, first = step.block_tables, None
    if window is not None:
        tables, first = batch.windowed_block_tables(step, window)
    builder = CommonMetadataBuilder(B, window)
    builder.prepare()
    got = builder.build(
        step.context_lens_np + step.query_lens_np,
        step.query_lens_np,
        slot_mapping=step.slot_mapping,
        seq_lens_tensor=step.seq_lens,
        block_tables=tables,
        block_table_first_block=first,
    )
    assert step.input_ids.tolist() == ids
    assert step.positions.tolist() == pos
    for name in ("slot_mapping", "seq_lens_tensor", "query_start_loc", "seq_start_loc"):
        assert getattr(got, name).tolist() == getattr(want, name).tolist(), name
    assert got.context_lens_tensor.tolist() == want.context_lens_tensor.tolist()
    assert got.block_tables.tolist() == want.block_tables.tolist()
    for name in (
        "num_prefills",
        "num_prefill_tokens",
        "num_decode_tokens",
        "seq_lens",
        "max_query_len",
        "max_prefill_seq_len",
        "max_decode_seq_len",
        "query_lens",
        "context_lens",
        "block_table_first_block",
        "sliding_window",
    ):
        assert getattr(got, name) == getattr(want, name), name
    last = [i for i, s in enumerate(items) if s.completes_sequence]
    assert step.logits_indices == [int(want.query_start_loc[i + 1]) - 1 for i in last]


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("seed", range(4))
def test_prepared_inputs_equal_the_reference_builder_over_a_simulation(
    seed: int, window: int | None
) -> None:
    rng = random.Random(seed)
    batch = InputBatch(MAX_REQS, MAX_REQS * MAX_LEN, MAX_LEN, B, torch.device("cpu"))
    free_blocks = list(range(200))
    rng.shuffle(free_blocks)
    running: list[Request] = []
    # The block manager's tables, as the simulation keeps them; the batch learns each step's
    # appended blocks and the table length from the ScheduledRequest, as from the scheduler.
    tables: dict[str, list[int]] = {}
    rollbacks = 0
    counter = 0
    for _ in range(60):
        left: list[str] = []
        while len(running) < MAX_REQS and rng.random() < 0.5:
            prompt = [rng.randrange(1000) for _ in range(rng.randrange(1, 30))]
            running.append(Request(f"r{counter}", prompt, SamplingParams()))
            counter += 1
        items = []
        for req in running:
            todo = req.num_tokens - req.num_computed_tokens
            n = min(todo, rng.choice([1, 3, 8, 40]))
            need = -(-(req.num_computed_tokens + n) // B)
            table = tables.setdefault(req.request_id, [])
            new = []
            while len(table) < need:
                new.append(free_blocks.pop())
                table.append(new[-1])
            items.append(ScheduledRequest(req, n, 0, (new,), (len(table),)))
        items.sort(key=lambda s: s.num_new_tokens == 1)
        batch.remove_requests(left)
        assert_same(batch, items, window, tables)
        for item in items:  # what the scheduler's update_from_output does
            req = item.request
            req.num_computed_tokens += item.num_new_tokens
            if item.completes_sequence or req.num_computed_tokens == req.num_tokens:
                req.append_output_token(rng.randrange(1000))
        for req in list(running):
            fate = rng.random()
            table = tables.get(req.request_id, [])
            if req.num_tokens >= MAX_LEN - 1 or fate < 0.05:  # finished
                running.remove(req)
                free_blocks += tables.pop(req.request_id, [])
                batch.remove_requests([req.request_id])
            elif fate < 0.1:  # preempted: recomputed from scratch, with new blocks
                free_blocks += tables.pop(req.request_id, [])
                req.num_computed_tokens = 0
                batch.remove_requests([req.request_id])
            elif fate < 0.2 and req.num_computed_tokens > B:  # rolled back, keeps its row
                # As `BlockManager.truncate` does for rejected speculative tokens: the tail
                # blocks go back to the pool, and the next step regrows the table with others.
                req.num_computed_tokens = rng.randrange(1, req.num_computed_tokens)
                keep = -(-req.num_computed_tokens // B)
                free_blocks[:0] = table[keep:]  # reused last: the regrown tail differs
                del table[keep:]
                rollbacks += 1
    assert set(batch.req_index) == {r.request_id for r in running if r.num_computed_tokens}
    assert rollbacks > 0


def test_a_full_batch_refuses_a_new_row_with_a_clear_error() -> None:
    batch = InputBatch(1, 16, MAX_LEN, B, torch.device("cpu"))
    a, b = (Request(rid, [1, 2], SamplingParams()) for rid in ("a", "b"))
    batch.prepare(*_prep([ScheduledRequest(a, 2, 0, ([0],), (1,))]))
    with pytest.raises(RuntimeError, match="no free row for request b"):
        batch.prepare(*_prep([ScheduledRequest(b, 2, 0, ([0],), (1,))]))
    batch.remove_requests(["a"])
    assert np.array_equal(
        batch.prepare(*_prep([ScheduledRequest(b, 2, 0, ([0],), (1,))])).rows, [0]
    )


def test_blocks_the_runner_never_saw_are_a_clear_error() -> None:
    """A step whose new blocks start past the mirror's end means a step was lost."""
    batch = InputBatch(2, 16, MAX_LEN, B, torch.device("cpu"))
    req = Request("a", list(range(10)), SamplingParams())
    batch.prepare(*_prep([ScheduledRequest(req, 4, 0, ([5],), (1,))]))
    req.num_computed_tokens = 4
    with pytest.raises(RuntimeError, match="mirrors 1 blocks, but the step's new blocks start"):
        batch.prepare(*_prep([ScheduledRequest(req, 6, 0, ([9],), (3,))]))


def _prep(items: list) -> tuple[list, list]:
    return items, states_of(items)
