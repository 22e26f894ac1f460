"""Tests for tokenwise.attention.utils; expected slots are worked out by hand from
``slot = table[i // B] * B + i % B``."""

from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import PretrainedConfig

from tokenwise.attention import utils
from tokenwise.attention.utils import (
    PAD_SLOT_ID,
    AttentionType,
    MLADims,
    compute_slot_mapping,
    compute_slot_mapping_start_idx,
    get_mla_dims,
    get_num_prefill_decode_query_kv_tokens,
    get_seq_len_block_table_args,
    is_all_cross_attn_metadata_set,
    is_all_encoder_attn_metadata_set,
    is_block_tables_empty,
)


def _slots(
    seq_len: int,
    context_len: int,
    start_idx: int,
    block_size: int,
    table: list[int],
    *,
    profile: bool = False,
    seq_id: int = 0,
) -> list[int]:
    out: list[int] = []
    tables = None if profile else {seq_id: table}
    compute_slot_mapping(profile, out, seq_id, seq_len, context_len, start_idx, block_size, tables)
    return out


def _reference(
    seq_len: int, context_len: int, start_idx: int, block_size: int, table: list[int]
) -> list[int]:
    """Token-by-token restatement of the spec, independent of the implementation."""
    out: list[int] = []
    for pos in range(context_len, seq_len):
        if pos < start_idx:
            out.append(-1)
        else:
            out.append(table[pos // block_size] * block_size + pos % block_size)
    return out


# --- compute_slot_mapping_start_idx -------------------------------------------------


@pytest.mark.parametrize(
    ("is_prompt", "query_len", "window", "expected"),
    [(True, 10, 8, 2), (True, 5, 8, 0), (True, 8, 8, 0), (True, 10, None, 0), (False, 10, 8, 0)],
)
def test_start_idx(is_prompt: bool, query_len: int, window: int | None, expected: int) -> None:
    assert compute_slot_mapping_start_idx(is_prompt, query_len, 0, window) == expected


# --- compute_slot_mapping: spec examples and edge cases -------------------------------


def test_spec_example_with_context() -> None:
    assert _slots(6, 2, 0, 4, [3, 7]) == [14, 15, 28, 29]


def test_spec_example_without_context() -> None:
    assert _slots(6, 0, 0, 4, [3, 7]) == [12, 13, 14, 15, 28, 29]


def test_spec_example_wrapped_sliding_window() -> None:
    start = compute_slot_mapping_start_idx(True, 10, 0, 8)
    assert start == 2
    assert _slots(10, 0, start, 4, [0, 1, 0]) == [-1, -1, 2, 3, 4, 5, 6, 7, 0, 1]


def test_appends_in_place_after_existing_entries() -> None:
    out = [99, PAD_SLOT_ID]
    compute_slot_mapping(False, out, 5, 3, 1, 0, 4, {5: [2], 6: [8]})
    assert out == [99, -1, 9, 10]


def test_context_equal_to_seq_len_appends_nothing() -> None:
    assert _slots(4, 4, 0, 4, [3]) == []


def test_start_idx_beyond_context_pads_the_gap() -> None:
    # positions 1, 2 padded; position 3 -> block 5, offset 3
    assert _slots(4, 1, 3, 4, [5]) == [-1, -1, 23]


def test_start_idx_past_seq_len_still_one_entry_per_token() -> None:
    assert _slots(4, 1, 9, 4, [5]) == [-1, -1, -1]


def test_block_boundary_crossings() -> None:
    # block size 2: positions 1..5 live in blocks 4, 9, 9, 1, 1
    assert _slots(6, 1, 0, 2, [4, 9, 1]) == [9, 18, 19, 2, 3]


def test_block_size_one_maps_positions_to_table_entries() -> None:
    assert _slots(3, 0, 0, 1, [7, 2, 5]) == [7, 2, 5]


def test_sliding_window_with_chunked_prefill() -> None:
    # chunk of 6 tokens after 2 cached ones, window 3 -> start 3, position 2 padded
    start = compute_slot_mapping_start_idx(True, 6, 2, 3)
    assert start == 3
    assert _slots(8, 2, start, 4, [2, 5]) == [-1, 11, 20, 21, 22, 23]


def test_profile_run_pads_every_token() -> None:
    assert _slots(3, 0, 0, 4, [1], profile=True) == [PAD_SLOT_ID] * 3


def test_empty_tables_are_treated_as_profile_run() -> None:
    out: list[int] = []
    compute_slot_mapping(False, out, 0, 2, 0, 0, 4, {0: None})
    assert out == [-1, -1]


def test_short_block_table_is_rejected() -> None:
    with pytest.raises(ValueError, match="block table"):
        _slots(9, 0, 0, 4, [1, 2])


def test_context_longer_than_sequence_is_rejected() -> None:
    with pytest.raises(ValueError, match="context_len"):
        _slots(2, 3, 0, 4, [1])


def test_long_range_uses_numpy_path() -> None:
    table = list(range(40, 0, -1))
    n = utils._COMPUTE_SLOT_MAPPING_NUMPY_THRESHOLD + 10
    with mock.patch.object(utils, "_slots_python", side_effect=AssertionError("python path")):
        out = _slots(n, 0, 0, 16, table)
    assert out == _reference(n, 0, 0, 16, table)
    # position 17 is offset 1 of the second block, which is block 39
    assert out[17] == 39 * 16 + 1


def test_short_range_uses_python_path() -> None:
    with mock.patch.object(utils, "_slots_numpy", side_effect=AssertionError("numpy path")):
        assert _slots(3, 0, 0, 4, [2]) == [8, 9, 10]


# --- compute_slot_mapping: properties -------------------------------------------------


@st.composite
def _slot_cases(draw: st.DrawFn) -> tuple[int, int, int, int, list[int], bool]:
    block_size = draw(st.integers(1, 32))
    seq_len = draw(st.integers(0, 600))
    context_len = draw(st.integers(0, seq_len))
    start_idx = draw(st.integers(0, seq_len + 8))
    num_blocks = -(-seq_len // block_size) + draw(st.integers(0, 2))
    table = draw(st.lists(st.integers(0, 10_000), min_size=num_blocks, max_size=num_blocks))
    profile = draw(st.booleans())
    return seq_len, context_len, start_idx, block_size, table, profile


@settings(max_examples=150, deadline=None)
@given(_slot_cases())
def test_numpy_and_python_paths_agree(case: tuple[int, int, int, int, list[int], bool]) -> None:
    seq_len, context_len, start_idx, block_size, table, profile = case
    lo = min(max(start_idx, context_len), seq_len)
    assert utils._slots_numpy(table, lo, seq_len, block_size) == utils._slots_python(
        table, lo, seq_len, block_size
    )
    with mock.patch.object(utils, "_COMPUTE_SLOT_MAPPING_NUMPY_THRESHOLD", 0):
        via_numpy = _slots(seq_len, context_len, start_idx, block_size, table, profile=profile)
    with mock.patch.object(utils, "_COMPUTE_SLOT_MAPPING_NUMPY_THRESHOLD", 10**9):
        via_python = _slots(seq_len, context_len, start_idx, block_size, table, profile=profile)
    assert via_numpy == via_python
    expected_len = seq_len if profile else seq_len - context_len
    assert len(via_numpy) == expected_len


@settings(max_examples=150, deadline=None)
@given(_slot_cases())
def test_public_function_matches_reference(
    case: tuple[int, int, int, int, list[int], bool],
) -> None:
    seq_len, context_len, start_idx, block_size, table, _ = case
    got = _slots(seq_len, context_len, start_idx, block_size, table)
    assert got == _reference(seq_len, context_len, start_idx, block_size, table)


# --- is_block_tables_empty ------------------------------------------------------------


@pytest.mark.parametrize(
    ("tables", "expected"),
    [(None, True), ({}, True), ({0: None, 1: None}, True), ({0: None, 1: [3]}, False),
     ({0: []}, False), ({0: [1, 2]}, False)],
)  # fmt: skip
def test_is_block_tables_empty(tables: utils.BlockTables, expected: bool) -> None:
    assert is_block_tables_empty(tables) is expected


# --- attention-type getters -----------------------------------------------------------


def _metadata(**overrides: object) -> SimpleNamespace:
    fields = dict(
        num_prefill_tokens=7, num_decode_tokens=3, num_encoder_tokens=11,
        seq_lens_tensor="seq_lens", max_prefill_seq_len=5, max_decode_seq_len=9,
        block_tables="self_tables", encoder_seq_lens=[6, 5],
        encoder_seq_lens_tensor="enc_lens", max_encoder_seq_len=6,
        cross_slot_mapping="cross_slots", cross_block_tables="cross_tables",
    )  # fmt: skip
    fields.update(overrides)
    return SimpleNamespace(**fields)


@pytest.mark.parametrize(
    ("attn_type", "expected"),
    [(AttentionType.DECODER, (7, 7, 3)), (AttentionType.ENCODER_ONLY, (7, 7, 3)),
     (AttentionType.ENCODER, (11, 11, 0)), (AttentionType.ENCODER_DECODER, (7, 11, 3)),
     ("encoder_decoder", (7, 11, 3))],
)  # fmt: skip
def test_num_prefill_decode_query_kv_tokens(
    attn_type: AttentionType | str, expected: tuple[int, int, int]
) -> None:
    assert get_num_prefill_decode_query_kv_tokens(_metadata(), attn_type) == expected


@pytest.mark.parametrize("attn_type", [AttentionType.ENCODER, AttentionType.ENCODER_DECODER])
def test_num_tokens_requires_only_num_encoder_tokens(attn_type: AttentionType) -> None:
    # The per-sequence encoder lengths are the stricter checks' business, not this getter's.
    sparse = _metadata(
        encoder_seq_lens=None, encoder_seq_lens_tensor=None, max_encoder_seq_len=None
    )
    assert not is_all_encoder_attn_metadata_set(sparse)
    assert get_num_prefill_decode_query_kv_tokens(sparse, attn_type)[1] == 11
    with pytest.raises(ValueError, match="num_encoder_tokens"):
        get_num_prefill_decode_query_kv_tokens(_metadata(num_encoder_tokens=None), attn_type)


def test_num_tokens_rejects_unknown_type() -> None:
    with pytest.raises(ValueError, match="bogus"):
        get_num_prefill_decode_query_kv_tokens(_metadata(), "bogus")


@pytest.mark.parametrize(
    ("attn_type", "is_prompt", "expected"),
    [(AttentionType.DECODER, True, ("seq_lens", 5, "self_tables")),
     (AttentionType.DECODER, False, ("seq_lens", 9, "self_tables")),
     (AttentionType.ENCODER_DECODER, False, ("enc_lens", 6, "cross_tables")),
     (AttentionType.ENCODER, True, ("enc_lens", 6, None))],
)  # fmt: skip
def test_seq_len_block_table_args(
    attn_type: AttentionType, is_prompt: bool, expected: tuple[object, int, object]
) -> None:
    assert get_seq_len_block_table_args(_metadata(), is_prompt, attn_type) == expected


def test_seq_len_block_table_args_rejects_encoder_only() -> None:
    with pytest.raises(ValueError, match="ENCODER_ONLY"):
        get_seq_len_block_table_args(_metadata(), True, AttentionType.ENCODER_ONLY)


def test_encoder_and_cross_metadata_checks() -> None:
    assert is_all_encoder_attn_metadata_set(_metadata())
    assert is_all_cross_attn_metadata_set(_metadata())
    # cross fields missing: encoder attention is possible, cross-attention is not
    assert is_all_encoder_attn_metadata_set(_metadata(cross_block_tables=None))
    assert not is_all_cross_attn_metadata_set(_metadata(cross_slot_mapping=None))
    assert not is_all_encoder_attn_metadata_set(_metadata(encoder_seq_lens=None))
    assert not is_all_cross_attn_metadata_set(_metadata(encoder_seq_lens_tensor=None))
    # decoder-only metadata lacks the fields entirely
    bare = SimpleNamespace(num_prefill_tokens=1)
    assert not is_all_encoder_attn_metadata_set(bare)
    assert not is_all_cross_attn_metadata_set(bare)


# --- MLA dims -------------------------------------------------------------------------

_MLA = dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)


def test_mla_dims_from_hf_config() -> None:
    dims = get_mla_dims(PretrainedConfig(q_lora_rank=1536, **_MLA))
    assert dims == MLADims(1536, 512, 128, 64, 128)


def test_mla_dims_without_q_lora_rank_via_wrapper() -> None:
    wrapper = SimpleNamespace(hf_config=PretrainedConfig(**_MLA))
    assert get_mla_dims(wrapper) == MLADims(None, 512, 128, 64, 128)


def test_mla_dims_missing_field_is_named() -> None:
    fields = {k: v for k, v in _MLA.items() if k != "qk_rope_head_dim"}
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        get_mla_dims(PretrainedConfig(**fields))


def test_mla_dims_is_frozen() -> None:
    dims = MLADims(None, 1, 2, 3, 4)
    with pytest.raises(AttributeError, match="cannot assign to field 'v_head_dim'"):
        dims.v_head_dim = 5  # type: ignore[misc]
