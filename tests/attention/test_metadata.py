"""`AttentionMetadata` and `CommonMetadataBuilder` (SPEC §3).

Every expected slot, offset and table below is worked out by hand from
`slot = table[i // B] * B + i % B` with block size B = 4; nothing is copied from the builder.
"""

from __future__ import annotations

import pytest
import torch

from tokenwise.attention.graph_state import CommonAttentionState
from tokenwise.attention.metadata import AttentionMetadata, CommonMetadataBuilder
from tokenwise.attention.utils import PAD_SLOT_ID

B = 4


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
    b = CommonMetadataBuilder(block_size=B)
    b.add_sequence(0, context_len=0, query_len=6, block_table=[3, 7])
    b.add_sequence(1, context_len=5, query_len=3, block_table=[2, 9])
    b.add_sequence(2, context_len=4, query_len=1, block_table=[5, 1, 11])
    b.add_sequence(3, context_len=9, query_len=1, block_table=[0, 6, 8])
    return b.build(seq_lens=[6, 8, 5, 10], query_lens=[6, 3, 1, 1])


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
    b = CommonMetadataBuilder(block_size=B)
    b.add_sequence(0, 0, 3, [4])
    md = b.build([3], [3])
    assert md.decode_metadata is None and md.prefill_metadata is not None
    b.prepare()
    b.add_sequence(0, 3, 1, [4])
    md = b.build([4], [1])
    assert md.prefill_metadata is None and md.decode_metadata is not None
    assert (md.num_prefills, md.num_prefill_tokens, md.num_decode_tokens) == (0, 0, 1)
    assert _ints(md.slot_mapping) == [4 * 4 + 3]


def test_chunked_prompt_counts_as_prefill() -> None:
    b = CommonMetadataBuilder(block_size=B)
    b.add_sequence(7, context_len=8, query_len=2, block_table=[1, 2, 3])
    md = b.build([10], [2])
    assert md.num_prefills == 1 and md.num_prefill_tokens == 2 and md.num_decode_tokens == 0
    assert _ints(md.slot_mapping) == [12, 13]  # positions 8, 9 -> block 3
    assert md.max_prefill_seq_len == 10 and md.max_decode_seq_len == 0


def test_prefill_after_decode_is_an_error() -> None:
    b = CommonMetadataBuilder(block_size=B)
    b.add_sequence(0, 4, 1, [1, 2])
    with pytest.raises(ValueError, match="before decode"):
        b.add_sequence(1, 0, 3, [3])
    # A chunk with context is a prefill too.
    with pytest.raises(ValueError, match="before decode"):
        b.add_sequence(2, 4, 2, [5, 6])


def test_invalid_inputs() -> None:
    b = CommonMetadataBuilder(block_size=B)
    with pytest.raises(ValueError):
        b.add_sequence(0, 3, 0, [1])
    b.add_sequence(0, 0, 3, [1])
    with pytest.raises(ValueError):
        b.build([3], [2])
    with pytest.raises(ValueError):  # block table too short for 9 tokens
        b.add_sequence(1, 0, 9, [1, 2])


def test_prepare_resets_state() -> None:
    b = CommonMetadataBuilder(block_size=B)
    b.add_sequence(0, 0, 5, [1, 2])
    b.add_sequence(1, 2, 1, [3])
    b.build([5, 3], [5, 1])
    b.prepare()
    b.add_sequence(2, 1, 1, [6])
    md = b.build([2], [1])
    assert (md.num_prefills, md.num_prefill_tokens, md.num_decode_tokens) == (0, 0, 1)
    assert _ints(md.slot_mapping) == [25]
    assert _ints(md.block_tables) == [[6]]


def test_sliding_window_trims_leading_blocks() -> None:
    """Window 5: the earliest query (position context) sees keys >= context - 4; the first kept
    block is max(0, context - 5 + 1) // 4."""
    b = CommonMetadataBuilder(block_size=B, sliding_window=5)
    b.add_sequence(0, context_len=0, query_len=10, block_table=[10, 11, 12])  # first 0
    b.add_sequence(1, context_len=8, query_len=3, block_table=[4, 5, 6])  # (8-4)//4 = 1
    b.add_sequence(2, context_len=7, query_len=1, block_table=[7, 8])  # (7-4)//4 = 0
    b.add_sequence(3, context_len=13, query_len=1, block_table=[0, 1, 2, 3])  # 9//4 = 2
    b.add_sequence(4, context_len=3, query_len=1, block_table=[9])  # max(0, -1) -> 0
    md = b.build([10, 11, 8, 14, 4], [10, 3, 1, 1, 1])
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


def test_graph_padding_without_state() -> None:
    b = CommonMetadataBuilder(block_size=B)
    b.add_sequence(0, 4, 1, [5, 1])
    b.add_sequence(1, 9, 1, [0, 6, 8])
    md = b.build([5, 10], [1, 1], cuda_graph_pad_size=2, batch_size=4)
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
    state = CommonAttentionState(max_batch_size=8, max_blocks_per_seq=4, block_size=B)
    state.graph_block_tables.fill_(99)  # stale contents from an earlier step
    b = CommonMetadataBuilder(block_size=B, attn_state=state)
    b.add_sequence(0, 4, 1, [5, 1])
    b.add_sequence(1, 9, 1, [0, 6, 8])
    b.add_sequence(2, 2, 1, [7])
    md = b.build([5, 10, 3], [1, 1, 1], cuda_graph_pad_size=1, batch_size=4)
    assert md.use_cuda_graph is True
    assert md.num_decode_tokens == 4
    assert _ints(md.slot_mapping) == [4, 33, 30, PAD_SLOT_ID]
    assert md.block_tables.data_ptr() == state.graph_block_tables.data_ptr()
    assert _ints(md.block_tables) == [[5, 1, 0, 0], [0, 6, 8, 0], [7, 0, 0, 0], [0, 0, 0, 0]]
    # Rows past the batch are not this step's concern and are left alone.
    assert (state.graph_block_tables[4:] == 99).all()
    assert md.seq_lens == [5, 10, 3, 1]


def test_graph_padding_rejects_oversized_batches() -> None:
    state = CommonAttentionState(max_batch_size=2, max_blocks_per_seq=2, block_size=B)
    b = CommonMetadataBuilder(block_size=B, attn_state=state)
    b.add_sequence(0, 4, 1, [5, 1])
    with pytest.raises(ValueError):
        b.build([5], [1], cuda_graph_pad_size=2, batch_size=3)
    b.prepare()
    b.add_sequence(0, 9, 1, [0, 6, 8])  # 3 blocks > max_blocks_per_seq
    with pytest.raises(ValueError):
        b.build([10], [1], cuda_graph_pad_size=1, batch_size=2)


def test_graph_batch_with_sliding_window_keeps_whole_tables() -> None:
    """A captured graph's metadata has every row starting at block 0 (its host-side offsets are
    fixed at capture), so a graph batch must not trim: the window is applied by masking."""
    state = CommonAttentionState(max_batch_size=4, max_blocks_per_seq=4, block_size=B)
    b = CommonMetadataBuilder(block_size=B, sliding_window=5, attn_state=state)
    b.add_sequence(0, 13, 1, [0, 1, 2, 3])  # would trim to [2, 3] outside a graph
    b.add_sequence(1, 5, 1, [6, 7])
    md = b.build([14, 6], [1, 1], cuda_graph_pad_size=1, batch_size=3)
    assert md.block_table_first_block == [0, 0, 0]
    assert _ints(md.block_tables) == [[0, 1, 2, 3], [6, 7, 0, 0], [0, 0, 0, 0]]
    assert _ints(md.slot_mapping) == [13, 29, PAD_SLOT_ID]
    # The same builder without a graph still trims.
    b.prepare()
    b.add_sequence(0, 13, 1, [0, 1, 2, 3])
    md = b.build([14], [1])
    assert md.block_table_first_block == [2]
    assert _ints(md.block_tables) == [[2, 3]]
