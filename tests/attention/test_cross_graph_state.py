"""CUDA-graph buffers of encoder-decoder decode steps (`CommonAttentionState`), on CPU.

A cross-attention decode is captured once on the state's persistent buffers with the fake
capturer (`EagerReplayCapturer`: a replay calls the captured function again on the same
buffers, as a replayed graph reads the same memory); each real step's encoder lengths and cross
block tables are copied in with `prepare_graph_input_buffers`, and the replay must equal the
eager cross-attention of that step. Stale buffers would give the previous step's answer.
"""

from __future__ import annotations

import pytest
import torch

from tokenwise.attention.backends.cross_attention import EncoderDecoderAttentionImpl
from tokenwise.attention.graph_state import CommonAttentionState
from tokenwise.attention.metadata import AttentionMetadata
from tokenwise.attention.utils import AttentionType
from tokenwise.compilation.cuda_graph import EagerReplayCapturer

HEADS, KV_HEADS, HEAD, BLOCK = 4, 2, 8, 4
NUM_BLOCKS, CAPTURE_SIZE, MAX_CROSS_BLOCKS = 24, 8, 6


def decode_step(
    enc_lens: list[int], tables: list[list[int]], num_encoder_tokens: int = 0
) -> AttentionMetadata:
    """Eager metadata of a decode-only step of len(enc_lens) sequences (self-attention parts
    are irrelevant to cross-attention and kept minimal)."""
    n = len(enc_lens)
    width = max(len(t) for t in tables)
    md = AttentionMetadata.for_sequences(
        [1] * n,
        [3] * n,
        torch.full((n,), -1, dtype=torch.int64),
        torch.zeros((n, 1), dtype=torch.int32),
        seq_lens_tensor=torch.full((n,), 4, dtype=torch.int32),
        block_size=BLOCK,
    )
    md.num_encoder_tokens = num_encoder_tokens
    md.encoder_seq_lens = list(enc_lens)
    md.encoder_seq_lens_tensor = torch.tensor(enc_lens, dtype=torch.int32)
    md.max_encoder_seq_len = max(enc_lens)
    md.cross_slot_mapping = torch.empty(0, dtype=torch.int64)
    md.cross_block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables]).int()
    return md


def test_replayed_cross_decode_equals_eager_for_each_step() -> None:
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(2, NUM_BLOCKS + 1, BLOCK, KV_HEADS, HEAD, generator=g)
    impl = EncoderDecoderAttentionImpl(
        HEADS, HEAD, HEAD**-0.5, KV_HEADS, AttentionType.ENCODER_DECODER
    )
    state = CommonAttentionState(CAPTURE_SIZE, 4, BLOCK, max_cross_blocks_per_seq=MAX_CROSS_BLOCKS)
    no_kv = torch.empty(0, KV_HEADS * HEAD)
    query = torch.zeros(CAPTURE_SIZE, HEADS * HEAD)
    capturer = EagerReplayCapturer()
    with state.graph_capture(CAPTURE_SIZE, is_encoder_decoder_model=True):
        captured = state.graph_capture_get_metadata_for_batch(
            CAPTURE_SIZE, is_encoder_decoder_model=True
        )
        buffers = state.get_graph_input_buffers(captured, is_encoder_decoder_model=True)
        out = capturer.capture(lambda: impl.forward(query, no_kv, no_kv, cache, captured))
    assert buffers["cross_block_tables"].shape == (CAPTURE_SIZE, MAX_CROSS_BLOCKS)
    steps = [
        ([5, 17, 2], [[3, 9], [1, 2, 4, 8, 10], [7]]),
        ([24, 1, 9, 13, 4], [[0, 5, 6, 11, 12, 13], [14], [15, 16, 17], [18, 19, 20, 21], [22]]),
    ]
    for enc_lens, tables in steps:
        n = len(enc_lens)
        md = decode_step(enc_lens, tables)
        q = torch.randn(n, HEADS * HEAD, generator=g)
        state.prepare_graph_input_buffers(buffers, md, is_encoder_decoder_model=True)
        query[:n].copy_(q)
        capturer.replay()
        expected = impl.forward(q, no_kv, no_kv, cache, md)
        assert torch.allclose(out[:n], expected, atol=1e-6)
        assert buffers["encoder_seq_lens_tensor"][:n].tolist() == enc_lens
    assert capturer.num_replays == len(steps)


def test_steps_that_write_cross_kv_or_overflow_never_replay() -> None:
    state = CommonAttentionState(4, 4, BLOCK, max_cross_blocks_per_seq=2)
    with state.graph_capture(4, is_encoder_decoder_model=True):
        md = state.graph_capture_get_metadata_for_batch(4, is_encoder_decoder_model=True)
        buffers = state.get_graph_input_buffers(md, is_encoder_decoder_model=True)
    with pytest.raises(ValueError, match="runs an encoder"):
        step = decode_step([5], [[1, 2]], num_encoder_tokens=5)
        state.prepare_graph_input_buffers(buffers, step, is_encoder_decoder_model=True)
    with pytest.raises(ValueError, match="exceed the captured 2"):
        step = decode_step([9], [[1, 2, 3]])
        state.prepare_graph_input_buffers(buffers, step, is_encoder_decoder_model=True)
    with pytest.raises(ValueError, match="max_cross_blocks_per_seq"):
        with CommonAttentionState(4, 4, BLOCK).graph_capture(4, is_encoder_decoder_model=True):
            pass
