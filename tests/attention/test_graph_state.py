"""`CommonAttentionState`: the buffers behind graph capture and replay (forward-context.md §3).

No GPU is needed: capture itself happens in the runner; these are the buffers' contents and
the rules for when they may be used. Expected slots are hand-computed with block size 4.
"""

from __future__ import annotations

import pytest
import torch

from tests.attention._metadata_oracle import ListMetadataBuilder
from tokenwise.attention.graph_state import CommonAttentionState
from tokenwise.attention.utils import PAD_SLOT_ID

B = 4


def _state(max_bs: int = 8, max_blocks: int = 5) -> CommonAttentionState:
    return CommonAttentionState(max_batch_size=max_bs, max_blocks_per_seq=max_blocks, block_size=B)


def test_capture_metadata_is_all_padding() -> None:
    state = _state()
    with state.graph_capture(4):
        md = state.graph_capture_get_metadata_for_batch(4)
        small = state.graph_capture_get_metadata_for_batch(2)
    assert md.use_cuda_graph is True
    assert (md.num_prefills, md.num_prefill_tokens, md.num_decode_tokens) == (0, 0, 4)
    assert md.slot_mapping.tolist() == [PAD_SLOT_ID] * 4
    assert md.slot_mapping.dtype == torch.int64
    assert md.seq_lens_tensor is not None
    assert md.seq_lens_tensor.tolist() == [1, 1, 1, 1]
    assert md.block_tables.shape == (4, 5) and not md.block_tables.any()
    assert md.max_query_len == 1
    assert md.max_decode_seq_len == 5 * B  # the longest sequence a replay may hold
    assert md.prefill_metadata is None and md.decode_metadata is not None
    # Smaller batches are views of the same buffers (a graph per size, one set of buffers).
    assert small.num_decode_tokens == 2 and small.slot_mapping.shape == (2,)
    assert small.slot_mapping.data_ptr() == md.slot_mapping.data_ptr()
    assert small.block_tables.data_ptr() == md.block_tables.data_ptr()


def test_capture_size_limits() -> None:
    state = _state(max_bs=4)
    with pytest.raises(ValueError, match="exceeds max_batch_size"), state.graph_capture(5):
        pass
    with state.graph_capture(2), pytest.raises(ValueError, match="rows allocated"):
        state.graph_capture_get_metadata_for_batch(3)  # buffers only hold 2 rows


def test_calls_outside_capture_are_errors() -> None:
    state = _state()
    with pytest.raises(RuntimeError, match="inside graph_capture"):
        state.graph_capture_get_metadata_for_batch(2)
    with pytest.raises(RuntimeError, match="inside graph_capture"):
        state.graph_clone(2)
    with state.graph_capture(4):
        pass
    with pytest.raises(RuntimeError, match="inside graph_capture"):  # capture is over
        state.graph_capture_get_metadata_for_batch(2)


def test_capture_flag_cleared_on_error() -> None:
    state = _state()
    with pytest.raises(KeyError, match="capture failed"), state.graph_capture(4):
        raise KeyError("capture failed")
    with pytest.raises(RuntimeError, match="inside graph_capture"):
        state.graph_capture_get_metadata_for_batch(1)


def test_graph_clone_has_fresh_buffers() -> None:
    state = _state()
    with state.graph_capture(4):
        clone = state.graph_clone(3)
    assert clone is not state
    assert clone.max_batch_size == 3
    assert clone.max_blocks_per_seq == 5 and clone.block_size == B
    assert clone.graph_block_tables.shape == (3, 5)
    assert clone.graph_block_tables.data_ptr() != state.graph_block_tables.data_ptr()


def test_input_buffers_alias_the_capture_metadata() -> None:
    state = _state()
    with state.graph_capture(4):
        md = state.graph_capture_get_metadata_for_batch(4)
        buffers = state.get_graph_input_buffers(md)
    assert set(buffers) == {"slot_mapping", "seq_lens_tensor", "block_tables"}
    assert md.seq_lens_tensor is not None
    assert buffers["slot_mapping"].data_ptr() == md.slot_mapping.data_ptr()
    assert buffers["seq_lens_tensor"].data_ptr() == md.seq_lens_tensor.data_ptr()
    assert buffers["block_tables"].data_ptr() == md.block_tables.data_ptr()


def test_input_buffers_need_a_decode_batch() -> None:
    b = ListMetadataBuilder(B)
    b.add_sequence(0, 0, 3, [1])
    prefill_md = b.build([3], [3])
    state = _state()
    with pytest.raises(ValueError, match="only for decode batches"):
        state.get_graph_input_buffers(prefill_md)
    with state.graph_capture(2):
        buffers = state.get_graph_input_buffers(state.graph_capture_get_metadata_for_batch(2))
    with pytest.raises(ValueError, match="only decode batches replay"):
        state.prepare_graph_input_buffers(buffers, prefill_md)


def test_prepare_copies_real_batch_into_first_rows() -> None:
    state = _state()
    with state.graph_capture(4):
        md = state.graph_capture_get_metadata_for_batch(4)
        buffers = state.get_graph_input_buffers(md)
    b = ListMetadataBuilder(B)
    b.add_sequence(0, 4, 1, [5, 1])  # position 4 -> block 1 -> slot 4
    b.add_sequence(1, 9, 1, [0, 6, 8])  # position 9 -> block 8, offset 1 -> slot 33
    real = b.build([5, 10], [1, 1])
    state.prepare_graph_input_buffers(buffers, real)
    # The capture metadata sees the new contents through the same storage.
    assert md.seq_lens_tensor is not None
    assert md.slot_mapping.tolist() == [4, 33, PAD_SLOT_ID, PAD_SLOT_ID]
    assert md.seq_lens_tensor.tolist() == [5, 10, 1, 1]
    assert md.block_tables.tolist() == [
        [5, 1, 0, 0, 0],
        [0, 6, 8, 0, 0],
        [0, 0, 0, 0, 0],
        [0, 0, 0, 0, 0],
    ]


def test_prepare_with_padded_batch_from_builder() -> None:
    state = _state(max_bs=4, max_blocks=3)
    with state.graph_capture(4):
        md = state.graph_capture_get_metadata_for_batch(4)
        buffers = state.get_graph_input_buffers(md)
    b = ListMetadataBuilder(B)
    b.add_sequence(0, 2, 1, [7])  # slot 7*4 + 2 = 30
    b.add_sequence(1, 6, 1, [3, 9])  # slot 9*4 + 2 = 38
    b.add_sequence(2, 8, 1, [2, 4, 11])  # slot 11*4 + 0 = 44
    real = b.build([3, 7, 9], [1, 1, 1], cuda_graph_pad_size=1, batch_size=4)
    state.prepare_graph_input_buffers(buffers, real)
    assert md.seq_lens_tensor is not None
    assert md.slot_mapping.tolist() == [30, 38, 44, PAD_SLOT_ID]
    assert md.seq_lens_tensor.tolist() == [3, 7, 9, 1]
    assert md.block_tables.tolist() == [[7, 0, 0], [3, 9, 0], [2, 4, 11], [0, 0, 0]]


def test_begin_forward_is_a_no_op() -> None:
    state = _state()
    before = state.graph_block_tables.clone()
    assert state.begin_forward(object()) is None
    assert torch.equal(state.graph_block_tables, before)


def test_prepare_skips_buffers_the_batch_already_is() -> None:
    """Bound to the engine's input buffers, the decoder rows are already where the graph reads
    them: prepare copies nothing over them (a copy onto itself would be wasted work)."""
    slots = torch.full((4,), 7, dtype=torch.int64)
    lens, tables = torch.ones(4, dtype=torch.int32), torch.zeros((4, 5), dtype=torch.int32)
    state = _state(max_bs=4)
    state.bind_buffers(slots, lens, tables)
    assert state.graph_block_tables is tables
    with state.graph_capture(4):
        md = state.graph_capture_get_metadata_for_batch(4)
        buffers = state.get_graph_input_buffers(md)
    slots[:2] = torch.tensor([4, 33])
    lens[:2] = torch.tensor([5, 10])
    copies: list[torch.Tensor] = []
    real = md.decode_metadata
    assert real is not None
    original = torch.Tensor.copy_

    def spy(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        copies.append(self)
        return original(self, src, non_blocking)

    torch.Tensor.copy_ = spy  # type: ignore[method-assign]
    try:
        state.prepare_graph_input_buffers(buffers, real)
    finally:
        torch.Tensor.copy_ = original  # type: ignore[method-assign]
    assert copies == []
    assert md.slot_mapping.tolist() == [4, 33, PAD_SLOT_ID, PAD_SLOT_ID]
