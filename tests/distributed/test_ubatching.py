"""Micro-batch slicing: coverage, split requests, padding and per-slice sequence lengths."""

from __future__ import annotations

from itertools import accumulate

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenwise.config import ParallelConfig
from tokenwise.distributed import (
    UBatchSlice,
    check_ubatch_thresholds,
    create_ubatch_slices,
    pad_ubatch_slices,
    split_request_lengths,
)


def _owners(num_scheduled_tokens: list[int]) -> list[int]:
    """Request index of every token in the concatenated stream."""
    return [r for r, n in enumerate(num_scheduled_tokens) for _ in range(n)]


def _assert_partition(num_scheduled_tokens: list[int], slices: list[UBatchSlice]) -> None:
    total = sum(num_scheduled_tokens)
    covered = [t for s in slices for t in range(s.token_slice.start, s.token_slice.stop)]
    assert covered == list(range(total))
    owners = _owners(num_scheduled_tokens)
    for s in slices:
        expected = sorted({owners[t] for t in range(s.token_slice.start, s.token_slice.stop)})
        assert list(range(s.request_slice.start, s.request_slice.stop)) == expected


def test_split_inside_a_request_puts_it_in_both_slices() -> None:
    slices = create_ubatch_slices([4, 6, 2], 6)
    assert slices == [
        UBatchSlice(slice(0, 2), slice(0, 6)),
        UBatchSlice(slice(1, 3), slice(6, 12)),
    ]
    assert [s.num_tokens for s in slices] == [6, 6]
    _assert_partition([4, 6, 2], slices)


def test_split_on_a_request_boundary_shares_no_request() -> None:
    slices = create_ubatch_slices([4, 6, 2], 4)
    assert [(s.request_slice, s.token_slice) for s in slices] == [
        (slice(0, 1), slice(0, 4)),
        (slice(1, 3), slice(4, 12)),
    ]


def test_multiple_split_points() -> None:
    counts = [3, 5, 1, 7]
    slices = create_ubatch_slices(counts, [2, 8, 10])
    assert [s.token_slice for s in slices] == [
        slice(0, 2),
        slice(2, 8),
        slice(8, 10),
        slice(10, 16),
    ]
    assert [s.request_slice for s in slices] == [slice(0, 1), slice(0, 2), slice(2, 4), slice(3, 4)]
    _assert_partition(counts, slices)


def test_empty_slices_are_detected() -> None:
    at_end = create_ubatch_slices([2, 3], 5)
    assert not at_end[0].is_empty() and at_end[1].is_empty()
    assert at_end[1].num_tokens == 0 and at_end[1].num_requests == 0
    at_start = create_ubatch_slices([2, 3], 0)
    assert at_start[0].is_empty() and not at_start[1].is_empty()
    assert at_start[1].request_slice == slice(0, 2)


@pytest.mark.parametrize("points", [[6, 3], [-1], [13], []])
def test_invalid_split_points_are_rejected(points: list[int]) -> None:
    with pytest.raises(ValueError, match="split point"):
        create_ubatch_slices([4, 6, 2], points)


def test_requests_without_tokens_are_rejected() -> None:
    with pytest.raises(ValueError, match="request 1"):
        create_ubatch_slices([4, 0, 2], 3)


def test_padding_extends_only_the_last_slice() -> None:
    slices = create_ubatch_slices([4, 6, 2], 6)
    padded = pad_ubatch_slices(slices, num_total_tokens_padded=16, num_reqs_padded=4)
    assert padded[0] == slices[0]
    assert padded[1] == UBatchSlice(slice(1, 4), slice(6, 16))
    assert slices[1].token_slice == slice(6, 12)  # input left untouched
    tokens_only = pad_ubatch_slices(slices, 14)
    assert tokens_only[1] == UBatchSlice(slice(1, 3), slice(6, 14))
    with pytest.raises(ValueError, match="smaller"):
        pad_ubatch_slices(slices, 11)
    with pytest.raises(ValueError, match="smaller"):
        pad_ubatch_slices(slices, 16, num_reqs_padded=2)


def test_split_request_lengths_hand_worked_example() -> None:
    # Query lens [4, 6, 2]; request 1 straddles the cut at token 6 (2 tokens before, 4 after).
    qsl, seq_lens = [0, 4, 10, 12], [10, 6, 2]
    first, second = create_ubatch_slices([4, 6, 2], 6)
    assert split_request_lengths(qsl, seq_lens, first) == ([0, 4, 6], [10, 2])
    assert split_request_lengths(qsl, seq_lens, second) == ([0, 4, 6], [6, 2])


def test_split_request_lengths_keeps_tensor_types() -> None:
    qsl = torch.tensor([0, 4, 10, 12], dtype=torch.int32)
    seq_lens = torch.tensor([10, 6, 2], dtype=torch.int64)
    _, second = create_ubatch_slices([4, 6, 2], 6)
    out_qsl, out_lens = split_request_lengths(qsl, seq_lens, second)
    assert isinstance(out_qsl, torch.Tensor) and out_qsl.dtype == torch.int32
    assert isinstance(out_lens, torch.Tensor) and out_lens.dtype == torch.int64
    assert out_qsl.tolist() == [0, 4, 6] and out_lens.tolist() == [6, 2]


def test_split_request_lengths_rejects_inconsistent_input() -> None:
    qsl, seq_lens = [0, 4, 10, 12], [10, 6, 2]
    with pytest.raises(ValueError, match="padded"):
        split_request_lengths(qsl, seq_lens, UBatchSlice(slice(1, 3), slice(6, 16)))
    with pytest.raises(ValueError, match="does not match"):
        split_request_lengths(qsl, seq_lens, UBatchSlice(slice(1, 2), slice(6, 12)))
    with pytest.raises(ValueError, match="no tokens"):
        split_request_lengths(qsl, seq_lens, UBatchSlice(slice(0, 2), slice(4, 6)))
    with pytest.raises(ValueError, match="shorter than its query"):
        split_request_lengths(qsl, [10, 5, 2], UBatchSlice(slice(0, 3), slice(0, 12)))


def test_thresholds() -> None:
    cfg = ParallelConfig(
        enable_microbatching=True,
        microbatching_decode_token_threshold=8,
        microbatching_prefill_token_threshold=64,
    )
    assert check_ubatch_thresholds(cfg, 8, uniform_decode=True)
    assert not check_ubatch_thresholds(cfg, 7, uniform_decode=True)
    assert not check_ubatch_thresholds(cfg, 8, uniform_decode=False)
    assert not check_ubatch_thresholds(cfg, 63, uniform_decode=None)
    assert check_ubatch_thresholds(cfg, 64, uniform_decode=None)
    disabled = ParallelConfig(enable_microbatching=False)
    assert not check_ubatch_thresholds(disabled, 10_000, uniform_decode=True)


@st.composite
def _batches(draw: st.DrawFn) -> tuple[list[int], list[int], list[int]]:
    counts = draw(st.lists(st.integers(1, 9), min_size=1, max_size=8))
    contexts = draw(st.lists(st.integers(0, 20), min_size=len(counts), max_size=len(counts)))
    total = sum(counts)
    points = sorted(draw(st.lists(st.integers(0, total), min_size=1, max_size=3)))
    return counts, contexts, points


@settings(max_examples=150, deadline=None)
@given(_batches())
def test_slices_partition_tokens_and_keep_lengths_consistent(
    batch: tuple[list[int], list[int], list[int]],
) -> None:
    counts, contexts, points = batch
    seq_lens = [c + q for c, q in zip(contexts, counts, strict=True)]
    qsl = [0, *accumulate(counts)]
    slices = create_ubatch_slices(counts, points)
    assert len(slices) == len(points) + 1
    _assert_partition(counts, slices)

    # parts[r] lists (query tokens, seq len) of request r's pieces, in execution order.
    parts: dict[int, list[tuple[int, int]]] = {r: [] for r in range(len(counts))}
    for s in slices:
        if s.is_empty():
            continue
        sub_qsl, sub_lens = split_request_lengths(qsl, seq_lens, s)
        assert sub_qsl[0] == 0 and sub_qsl[-1] == s.num_tokens
        for k, r in enumerate(range(s.request_slice.start, s.request_slice.stop)):
            parts[r].append((sub_qsl[k + 1] - sub_qsl[k], sub_lens[k]))
    for r, pieces in parts.items():
        assert sum(q for q, _ in pieces) == counts[r]
        assert pieces[-1][1] == seq_lens[r]
        for i, (_, seq_len) in enumerate(pieces):
            later = sum(q for q, _ in pieces[i + 1 :])
            assert seq_len == seq_lens[r] - later
