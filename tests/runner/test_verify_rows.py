"""Which steps are uniform for graphs, and the decode rows a FULL verify graph reads.

`uniform_query_len` must tell a verify step (every request one token plus exactly k drafts)
from a step whose queries merely have the same length (a prompt chunk of 1 + k tokens), and
`write_decode_rows` must give each query token the block table of its request and the keys
that causal attention lets it see, in the input batch's own buffers.
"""

from __future__ import annotations

import numpy as np
import torch

from tests._states import states_of
from tokenwise.engine.request import Request
from tokenwise.engine.step_outputs import ScheduledRequest
from tokenwise.runner.input_batch import InputBatch
from tokenwise.runner.verify_rows import uniform_query_len, write_decode_rows
from tokenwise.sampling.params import SamplingParams

B = 4  # block size
K = 3


def batch() -> InputBatch:
    return InputBatch(8, 64, 32, B, torch.device("cpu"))


def decoding(rid: str, prompt_len: int, blocks: list[int], drafts: int) -> ScheduledRequest:
    """A request past its prompt (all of it computed but the last token) verifying `drafts`."""
    req = Request(rid, list(range(1, prompt_len + 1)), SamplingParams())
    req.num_computed_tokens = prompt_len - 1
    spec = list(range(100, 100 + drafts))
    return ScheduledRequest(req, 1 + drafts, 0, (blocks,), (len(blocks),), spec_token_ids=spec)


def test_only_steps_where_every_request_verifies_k_drafts_are_uniform_verify() -> None:
    b = batch()
    a, c = decoding("a", 6, [3, 7], K), decoding("c", 3, [5], K)
    assert uniform_query_len(b.prepare(*_prep([a, c])), 1 + K) == 1 + K
    assert uniform_query_len(b.prepare(*_prep([a, c])), None) == 0  # no verify graphs
    fewer = decoding("d", 6, [2, 4], K - 1)
    assert uniform_query_len(b.prepare(*_prep([a, fewer])), 1 + K) == 0
    # A prompt chunk of 1 + k tokens (no drafts) has the same query length: not a verify row.
    chunk = ScheduledRequest(
        Request("p", list(range(10)), SamplingParams()), 1 + K, 0, ([6],), (1,)
    )
    assert uniform_query_len(b.prepare(*_prep([chunk, a])), 1 + K) == 0
    plain = ScheduledRequest(a.request, 1, 0, ([3, 7],), (2,))
    assert uniform_query_len(b.prepare(*_prep([plain])), 1 + K) == 1


def test_decode_rows_see_their_request_blocks_and_causal_lengths() -> None:
    b = batch()
    a, c = decoding("a", 6, [3, 7, 9], K), decoding("c", 3, [5, 8], K)
    step = write_decode_rows(b, b.prepare(*_prep([a, c])))
    # a: context 5, queries at 5..8; c: context 2, queries at 2..5.
    assert step.num_reqs == step.num_tokens == 8
    assert step.seq_lens.tolist() == [6, 7, 8, 9, 3, 4, 5, 6]
    assert step.context_lens_np.tolist() == [5, 6, 7, 8, 2, 3, 4, 5]
    assert np.all(step.query_lens_np == 1)
    tables = step.block_tables.tolist()
    assert all(row[:3] == [3, 7, 9] for row in tables[:4])
    assert all(row[:2] == [5, 8] for row in tables[4:])
    # The rows are the batch's own buffers, which a captured graph reads.
    assert step.seq_lens.data_ptr() == b.seq_lens.device.data_ptr()
    assert step.block_tables.data_ptr() == b.block_tables.device.data_ptr()
    # Each token's K/V still goes to its own slot.
    assert step.slot_mapping.tolist() == [
        7 * B + 1, 7 * B + 2, 7 * B + 3, 9 * B + 0, 5 * B + 2, 5 * B + 3, 8 * B + 0, 8 * B + 1
    ]  # fmt: skip


def _prep(items: list) -> tuple[list, list]:
    return items, states_of(items)
