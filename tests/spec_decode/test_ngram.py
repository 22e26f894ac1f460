"""N-gram prompt lookup against a brute-force reference written from its definition."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenwise.spec_decode.ngram import NgramProposer


def reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The longest suffix window (max_n..min_n) that occurred earlier, its latest occurrence,
    and the k tokens after it, continuing the sequence as if the text kept repeating."""
    total = len(tokens)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = tokens[total - n :]
        for begin in range(total - n - 1, -1, -1):  # latest occurrence first, not the suffix
            if tokens[begin : begin + n] == suffix:
                extended = list(tokens)
                start = begin + n
                while len(extended) < start + k:
                    extended.append(extended[len(extended) - (total - start)])
                return extended[start : start + k]
    return []


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 4), min_size=0, max_size=40),
    k=st.integers(1, 6),
    min_n=st.integers(1, 3),
    extra=st.integers(0, 3),
)
def test_matches_reference(tokens: list[int], k: int, min_n: int, extra: int) -> None:
    proposer = NgramProposer(k, min_n, min_n + extra)
    got = proposer.propose(np.array(tokens, dtype=np.int64))
    assert got == reference(tokens, k, min_n, min_n + extra)


def test_copies_what_followed_the_latest_longest_match() -> None:
    # "7 8" occurs twice before the end; the later one is followed by 3, the earlier by 1.
    tokens = np.array([7, 8, 1, 2, 7, 8, 3, 4, 5, 7, 8])
    assert NgramProposer(3, 1, 2).propose(tokens) == [3, 4, 5]
    # Only a 3-token window counts: "9 7 8" never occurred, so nothing is proposed.
    assert NgramProposer(3, 3, 3).propose(np.array([7, 8, 1, 9, 7, 8])) == []


def test_repeating_pattern_is_continued_and_caps_hold() -> None:
    tokens = np.array([5, 6, 5, 6])
    assert NgramProposer(5, 1, 2).propose(tokens) == [5, 6, 5, 6, 5]
    assert NgramProposer(5, 1, 2).propose(tokens, max_tokens=2) == [5, 6]
    assert NgramProposer(5, 1, 2).propose(tokens, max_tokens=0) == []


@pytest.mark.parametrize("args", [(0, 1, 2), (2, 0, 1), (2, 3, 2)])
def test_bad_settings_are_refused(args: tuple[int, int, int]) -> None:
    with pytest.raises(ValueError):
        NgramProposer(*args)
