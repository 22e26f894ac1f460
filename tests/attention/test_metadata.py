"""`AttentionMetadata` and `CommonMetadataBuilder` (forward-context.md §3), as the engine builds.

Every expected slot, offset and table below is worked out by hand from
`slot = table[i // B] * B + i % B` with block size B = 4; nothing is copied from the builder.
Metadata comes from the engine's path (`InputBatch` + `CommonMetadataBuilder.prepare/build`,
via `engine_metadata`); the seed's list form (`ListMetadataBuilder`, the test oracle) must give
the same for every scenario.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.attention._metadata_oracle import ListMetadataBuilder, engine_metadata
from tokenwise.attention.graph_state import CommonAttentionState
from tokenwise.attention.metadata import AttentionMetadata, CommonMetadataBuilder
from tokenwise.attention.utils import PAD_SLOT_ID
from tokenwise.runner.input_batch import InputBatch

B = 4

MIXED = [(0, 6, [3, 7]), (5, 3, [2, 9]), (4, 1, [5, 1, 11]), (9, 1, [0, 6, 8])]
WINDOWED = [
    (0, 10, [10, 11, 12]),
    (8, 3, [4, 5, 6]),
    (7, 1, [7, 8]),
    (13, 1, [0, 1, 2, 3]),
    (3, 1, [9]),
]


def _ints(t: torch.Tensor | None) -> list:
    assert t is not None
    return t.tolist()


def _mixed_batch() -> AttentionMetadata:
    """Two prefills (one fresh, one chunk with context) then two decodes.

    seq 0: fresh prompt, context 0, query 6, table [3, 7]        -> 12 13 14 15 28 29
    seq 1: prompt chunk, context 5, query 3, table [2, 9]        -> positions 5..7 -> 37 38 39
    seq 2: decode, context 4, table [5, 1, 11] (one spare block) -> position 4 -> 1*4 + 0 = 4
    seq 3: decode, context 9, table [0, 6, 8]                    -> position 9 -> 8*4 + 1 = 33
    """
    return engine_metadata(B, MIXED)


def _oracle(seqs: list, window: int | None = None, graph_batch_size: int | None = None):
    b = ListMetadataBuilder(B, window)
    for i, (context, query, table) in enumerate(seqs):
        b.add_sequence(i, context, query, table)
    seq_lens, query_lens = [c + q for c, q, _ in seqs], [q for _, q, _ in seqs]
    if graph_batch_size is None:
        return b.build(seq_lens, query_lens)
    return b.build(seq_lens, query_lens, graph_batch_size - len(seqs), graph_batch_size)


@pytest.mark.parametrize(
    ("seqs", "window", "graph"),
    [
        (MIXED, None, None),
        (MIXED, 5, None),
        (WINDOWED, 5, None),
        (WINDOWED, None, None),
        ([(4, 1, [5, 1]), (9, 1, [0, 6, 8])], None, 4),
        ([(13, 1, [0, 1, 2, 3]), (5, 1, [6, 7])], 5, 3),
    ],
)
def test_engine_builder_equals_the_list_oracle(
    seqs: list, window: int | None, graph: int | None
) -> None:
    got = engine_metadata(B, seqs, window, graph)
    want = _oracle(seqs, window, graph)
    for name in ("slot_mapping", "seq_lens_tensor", "block_tables", "query_start_loc"):
        assert _ints(getattr(got, name)) == _ints(getattr(want, name)), name
    assert _ints(got.seq_start_loc) == _ints(want.seq_start_loc)
    assert _ints(got.context_lens_tensor) == _ints(want.context_lens_tensor)
    for name in (
        "num_prefills",
        "num_prefill_tokens",
        "num_decode_tokens",
        "seq_lens",
        "query_lens",
        "context_lens",
        "max_query_len",
        "max_prefill_seq_len",
        "max_decode_seq_len",
        "block_table_first_block",
        "sliding_window",
        "use_cuda_graph",
    ):
        assert getattr(got, name) == getattr(want, name), name


def test_counts_and_flat_fields() -> None:
    md = _mixed_batch()
    assert md.num_prefills == 2
    assert md.num_prefill_tokens == 9
    assert md.num_decode_tokens == 2
    assert md.num_seqs == 4 and md.num_decodes == 2
    assert _ints(md.slot_mapping) == [12, 13, 14, 15, 28, 29, 37, 38, 39, 4, 33]
    assert md.slot_mapping.dtype == torch.int64
    assert md.seq_lens == [6, 8, 5, 10]
    assert _ints(md.seq_lens_tensor) == [6, 8, 5, 10]
    assert _ints(md.query_start_loc) == [0, 6, 9, 10, 11]
    assert _ints(md.seq_start_loc) == [0, 6, 14, 19, 29]
    assert _ints(md.context_lens_tensor) == [0, 5, 4, 9]
    assert md.context_lens == [0, 5, 4, 9]
    assert md.query_lens == [6, 3, 1, 1]
    for t in (md.seq_lens_tensor, md.query_start_loc, md.seq_start_loc, md.context_lens_tensor):
        assert t is not None and t.dtype == torch.int32
    assert md.max_query_len == 6
    assert md.max_prefill_seq_len == 8
    assert md.max_decode_seq_len == 10
    assert md.use_cuda_graph is False
    assert md.block_size == B and md.sliding_window is None


def test_block_tables_trimmed_to_needed_blocks_and_zero_padded() -> None:
    md = _mixed_batch()
    assert md.block_tables.dtype == torch.int32
    # seq 2 needs ceil(5 / 4) = 2 blocks: its spare block 11 is dropped; rows padded to 3.
    assert _ints(md.block_tables) == [[3, 7, 0], [2, 9, 0], [5, 1, 0], [0, 6, 8]]
    assert md.block_table_first_block == [0, 0, 0, 0]


def test_prefill_view() -> None:
    p = _mixed_batch().prefill_metadata
    assert p is not None
    assert (p.num_prefills, p.num_prefill_tokens, p.num_decode_tokens) == (2, 9, 0)
    assert _ints(p.slot_mapping) == [12, 13, 14, 15, 28, 29, 37, 38, 39]
    assert p.seq_lens == [6, 8]
    assert _ints(p.seq_lens_tensor) == [6, 8]
    assert _ints(p.query_start_loc) == [0, 6, 9]
    assert _ints(p.seq_start_loc) == [0, 6, 14]
    assert _ints(p.context_lens_tensor) == [0, 5]
    assert _ints(p.block_tables) == [[3, 7, 0], [2, 9, 0]]
    assert p.query_lens == [6, 3] and p.context_lens == [0, 5]
    assert p.max_query_len == 6
    assert p.max_prefill_seq_len == 8 and p.max_decode_seq_len == 0


def test_decode_view_rebases_start_locations() -> None:
    d = _mixed_batch().decode_metadata
    assert d is not None
    assert (d.num_prefills, d.num_prefill_tokens, d.num_decode_tokens) == (0, 0, 2)
    assert _ints(d.slot_mapping) == [4, 33]
    assert d.seq_lens == [5, 10]
    assert _ints(d.seq_lens_tensor) == [5, 10]
    assert _ints(d.query_start_loc) == [0, 1, 2]
    assert _ints(d.seq_start_loc) == [0, 5, 15]
    assert _ints(d.context_lens_tensor) == [4, 9]
    assert _ints(d.block_tables) == [[5, 1, 0], [0, 6, 8]]
    assert d.query_lens == [1, 1] and d.context_lens == [4, 9]
    assert d.max_query_len == 1
    assert d.max_decode_seq_len == 10 and d.max_prefill_seq_len == 0
    assert d.num_seqs == 2 and d.num_decodes == 2


def test_views_absent_for_pure_batches() -> None:
    md = engine_metadata(B, [(0, 3, [4])])
    assert md.decode_metadata is None and md.prefill_metadata is not None
    md = engine_metadata(B, [(3, 1, [4])])
    assert md.prefill_metadata is None and md.decode_metadata is not None
    assert (md.num_prefills, md.num_prefill_tokens, md.num_decode_tokens) == (0, 0, 1)
    assert _ints(md.slot_mapping) == [4 * 4 + 3]


def test_chunked_prompt_counts_as_prefill() -> None:
    md = engine_metadata(B, [(8, 2, [1, 2, 3])])
    assert md.num_prefills == 1 and md.num_prefill_tokens == 2 and md.num_decode_tokens == 0
    assert _ints(md.slot_mapping) == [12, 13]  # positions 8, 9 -> block 3
    assert md.max_prefill_seq_len == 10 and md.max_decode_seq_len == 0


def _build(builder: CommonMetadataBuilder, seq_lens: list[int], query_lens: list[int], **kw):
    """`build` over hand-made buffers (shapes matching the lengths, contents irrelevant)."""
    n, t = len(seq_lens), sum(query_lens)
    buffers = {
        "slot_mapping": torch.zeros(kw.pop("num_slots", t), dtype=torch.int64),
        "seq_lens_tensor": torch.tensor(seq_lens, dtype=torch.int32),
        "block_tables": torch.zeros((kw.pop("num_rows", n), 2), dtype=torch.int32),
    }
    return builder.build(seq_lens, query_lens, **kw, **buffers)


def test_prefill_after_decode_is_an_error() -> None:
    b = CommonMetadataBuilder(B)
    b.prepare()
    with pytest.raises(ValueError, match="before decode"):
        _build(b, [5, 3], [1, 3])
    # A chunk with context is a prefill too.
    b.prepare()
    with pytest.raises(ValueError, match="before decode"):
        _build(b, [5, 6], [1, 2])


def test_invalid_inputs() -> None:
    b = CommonMetadataBuilder(B)
    b.prepare()
    with pytest.raises(ValueError, match="query_len >= 1"):
        _build(b, [3], [0])
    b.prepare()
    with pytest.raises(ValueError, match="seq_len >= query_len"):
        _build(b, [2], [3])
    b.prepare()
    with pytest.raises(ValueError, match="describe different batches"):
        b.build(
            [3, 4],
            [3],
            slot_mapping=torch.zeros(3, dtype=torch.int64),
            seq_lens_tensor=torch.ones(1, dtype=torch.int32),
            block_tables=torch.zeros((1, 1), dtype=torch.int32),
        )
    b.prepare()
    with pytest.raises(ValueError, match="do not fit 1 sequences of 3 query tokens"):
        _build(b, [3], [3], num_slots=2)


def test_build_needs_prepare_every_step() -> None:
    b = CommonMetadataBuilder(B)
    with pytest.raises(RuntimeError, match="without prepare"):
        _build(b, [5], [1])
    b.prepare()
    md = _build(b, [5], [1])
    assert md.num_decode_tokens == 1
    with pytest.raises(RuntimeError, match="without prepare"):  # one build per prepare
        _build(b, [5], [1])


def test_sliding_window_trims_leading_blocks() -> None:
    """Window 5: the earliest query (position context) sees keys >= context - 4; the first kept
    block is max(0, context - 5 + 1) // 4."""
    # First blocks: 0; (8-4)//4 = 1; (7-4)//4 = 0; 9//4 = 2; max(0, -1) -> 0.
    md = engine_metadata(B, WINDOWED, sliding_window=5)
    assert md.block_table_first_block == [0, 1, 0, 2, 0]
    assert _ints(md.block_tables) == [
        [10, 11, 12],
        [5, 6, 0],
        [7, 8, 0],
        [2, 3, 0],
        [9, 0, 0],
    ]
    assert md.sliding_window == 5
    # Every new token is still written (no PAD): blocks are not recycled within a request.
    assert _ints(md.slot_mapping) == (
        [40, 41, 42, 43, 44, 45, 46, 47, 48, 49]
        + [24, 25, 26]  # positions 8..10 -> block 6
        + [35]  # position 7 -> block 8, offset 3
        + [13]  # position 13 -> block 3, offset 1
        + [39]  # position 3 -> block 9, offset 3
    )
    # The views carry the offsets of their own rows.
    assert md.prefill_metadata is not None and md.decode_metadata is not None
    assert md.prefill_metadata.block_table_first_block == [0, 1]
    assert md.decode_metadata.block_table_first_block == [0, 2, 0]


def test_graph_padding() -> None:
    md = engine_metadata(B, [(4, 1, [5, 1]), (9, 1, [0, 6, 8])], graph_batch_size=4)
    assert md.use_cuda_graph is True
    assert md.num_decode_tokens == 4 and md.num_prefills == 0
    assert _ints(md.slot_mapping) == [4, 33, PAD_SLOT_ID, PAD_SLOT_ID]
    assert md.seq_lens == [5, 10, 1, 1]
    assert _ints(md.seq_lens_tensor) == [5, 10, 1, 1]
    assert _ints(md.block_tables) == [[5, 1, 0], [0, 6, 8], [0, 0, 0], [0, 0, 0]]
    assert _ints(md.query_start_loc) == [0, 1, 2, 3, 4]
    d = md.decode_metadata
    assert d is not None and d.num_decode_tokens == 4
    assert _ints(d.slot_mapping) == [4, 33, PAD_SLOT_ID, PAD_SLOT_ID]


def test_graph_padding_uses_persistent_buffer() -> None:
    """A graph batch's tables are the input batch's buffer, which the graph state is bound to."""
    batch = InputBatch(8, 8, 16, B, torch.device("cpu"))
    state = CommonAttentionState(max_batch_size=8, max_blocks_per_seq=4, block_size=B)
    state.bind_buffers(batch.slot_mapping.device, batch.seq_lens.device, batch.block_tables.device)
    seqs = [(4, 1, [5, 1]), (9, 1, [0, 6, 8]), (2, 1, [7])]
    md = engine_metadata(B, seqs, graph_batch_size=4, batch=batch)
    assert md.use_cuda_graph is True
    assert md.num_decode_tokens == 4
    assert _ints(md.slot_mapping) == [4, 33, 30, PAD_SLOT_ID]
    assert md.block_tables.data_ptr() == state.graph_block_tables.data_ptr()
    assert _ints(md.block_tables) == [[5, 1, 0], [0, 6, 8], [7, 0, 0], [0, 0, 0]]
    assert md.seq_lens == [5, 10, 3, 1]


def test_graph_padding_rejects_what_is_not_padding() -> None:
    b = CommonMetadataBuilder(B)
    b.prepare()
    with pytest.raises(ValueError, match="padding must already be in the buffers"):
        _build(b, [5], [1], cuda_graph_pad_size=2, batch_size=3)
    b.prepare()
    with pytest.raises(ValueError, match="are not padding"):  # a real decode, not a pad row
        _build(b, [5, 9], [1, 1], cuda_graph_pad_size=1, batch_size=2)
    b.prepare()
    with pytest.raises(ValueError, match="untrimmed"):
        _build(b, [14, 1], [1, 1], cuda_graph_pad_size=1, batch_size=2,
               block_table_first_block=[2, 0])  # fmt: skip


def test_graph_batch_with_sliding_window_keeps_whole_tables() -> None:
    """A captured graph's metadata has every row starting at block 0 (its host-side offsets are
    fixed at capture), so a graph batch must not trim: the window is applied by masking."""
    seqs = [(13, 1, [0, 1, 2, 3]), (5, 1, [6, 7])]  # row 0 would trim to [2, 3] outside a graph
    md = engine_metadata(B, seqs, sliding_window=5, graph_batch_size=3)
    assert md.block_table_first_block == [0, 0, 0]
    assert _ints(md.block_tables) == [[0, 1, 2, 3], [6, 7, 0, 0], [0, 0, 0, 0]]
    assert _ints(md.slot_mapping) == [13, 29, PAD_SLOT_ID]
    # The same spec without a graph still trims.
    md = engine_metadata(B, seqs[:1], sliding_window=5)
    assert md.block_table_first_block == [2]
    assert _ints(md.block_tables) == [[2, 3]]


def test_unread_fields_are_derived_on_first_access() -> None:
    """`query_start_loc`, `seq_start_loc`, `context_lens_tensor`: no backend reads them per
    step, so nothing builds them until asked; then from the host lengths, once."""
    md = _mixed_batch()
    assert not {"query_start_loc", "seq_start_loc", "context_lens_tensor"} & set(vars(md))
    assert md.query_start_loc is md.query_start_loc
    assert md.query_start_loc.device == md.slot_mapping.device
    assert np.array_equal(md.context_lens_tensor.numpy(), [0, 5, 4, 9])
