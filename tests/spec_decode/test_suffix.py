"""Suffix decoding's tree and proposer: counts, frequency and recency, variable draft length,
the shared cache of earlier outputs, and incremental updates equal to building afresh."""

from __future__ import annotations

import numpy as np
import pytest

from tokenwise.spec_decode.suffix import SuffixProposer
from tokenwise.spec_decode.suffix_tree import BEST, CHILDREN, COUNT, Matcher, SuffixTree


def node_of(tree: SuffixTree, pattern: list[int]) -> list | None:
    node = tree.root
    for token in pattern:
        node = node[CHILDREN].get(token)
        if node is None:
            return None
    return node


def occurrences(text: list[int], pattern: list[int]) -> int:
    n = len(pattern)
    return sum(text[i : i + n] == pattern for i in range(len(text) - n + 1))


def test_counts_are_occurrences_of_every_substring_up_to_the_depth() -> None:
    rng = np.random.default_rng(0)
    text = rng.integers(0, 4, 60).tolist()
    tree = SuffixTree(5)
    tree.extend(text[:17])
    tree.extend(text[17:])  # in two parts: the same tree
    for length in (1, 2, 3, 5):
        for start in range(0, len(text) - length, 7):
            pattern = text[start : start + length]
            node = node_of(tree, pattern)
            assert node is not None and node[COUNT] == occurrences(text, pattern)
    assert node_of(tree, text[:6]) is None  # deeper than the tree
    # The suffix nodes are the text's own last 1..4 tokens.
    nodes = tree.suffix_nodes()
    assert [nodes[i] is node_of(tree, text[-i - 1 :]) for i in range(4)] == [True] * 4


def test_removing_a_sequence_takes_back_exactly_its_counts() -> None:
    tree = SuffixTree(4)
    tree.add_sequence([1, 2, 3, 1, 2, 4])
    tree.add_sequence([1, 2, 4, 4])
    assert node_of(tree, [1, 2])[COUNT] == 3
    assert node_of(tree, [1, 2])[BEST] == 4  # 4 follows "1 2" twice, 3 once
    tree.remove_sequence([1, 2, 4, 4])
    assert node_of(tree, [1, 2])[COUNT] == 2
    assert node_of(tree, [2, 4, 4]) is None
    tree.remove_sequence([1, 2, 3, 1, 2, 4])
    assert tree.root[CHILDREN] == {}


def test_equal_counts_go_to_the_most_recent_continuation() -> None:
    tree = SuffixTree(4)
    tree.extend([7, 1, 7, 2])
    assert node_of(tree, [7])[BEST] == 2
    tree.extend([7, 1])
    assert node_of(tree, [7])[BEST] == 1  # 1 now seen twice


def test_a_repeated_passage_is_proposed_as_far_as_the_match_allows() -> None:
    passage = list(range(100, 130))
    text = [*passage, 5, 6, *passage[:10]]
    proposer = SuffixProposer(16, max_tree_depth=24, max_cached_requests=0)
    drafts = proposer.propose(np.array(text), request_id="a")
    # The last 10 tokens matched; at most 10 drafts (factor 1), the tree's depth leaves 14.
    assert drafts == passage[10:20]
    assert proposer.propose(np.array(text), 3, request_id="a") == passage[10:13]
    half = SuffixProposer(16, max_tree_depth=24, max_cached_requests=0, max_spec_factor=0.5)
    assert half.propose(np.array(text), request_id="a") == passage[10:15]


def test_an_ambiguous_continuation_stops_under_min_token_prob() -> None:
    text = [1, 2, 3, 9, 1, 2, 4, 8, 1, 2]  # "1 2" was followed by 3 once and 4 once
    sure = SuffixProposer(8, max_tree_depth=8, max_cached_requests=0, min_token_prob=0.6)
    assert sure.propose(np.array(text), request_id="a") == []
    loose = SuffixProposer(8, max_tree_depth=8, max_cached_requests=0, min_token_prob=0.4)
    # The more recent of the two, then what followed it there (probability 0.5 each).
    assert loose.propose(np.array(text), request_id="a") == [4, 8]


def test_finished_outputs_serve_later_requests_and_the_oldest_leave() -> None:
    proposer = SuffixProposer(8, max_tree_depth=12, max_cached_requests=1)
    first = [50, 51, 52, 53, 54, 55, 56]
    proposer.propose(np.array([1, *first]), request_id="a")
    proposer.finish("a", [1, *first], prompt_len=1)
    assert proposer.num_tracked == 0
    # A new request whose text reaches "50 51 52 53" is continued from the cached output.
    assert proposer.propose(np.array([9, 50, 51, 52, 53]), request_id="b") == [54, 55, 56]
    proposer.finish("b", [9, 50, 51, 52, 53, 60, 61], prompt_len=5)  # evicts "a"
    assert proposer.propose(np.array([8, 52, 53, 54]), request_id="c") == []
    assert proposer.propose(np.array([8, 53, 60]), request_id="d") == [61]
    # The prompt itself never enters the cache.
    assert proposer.propose(np.array([7, 9, 50]), request_id="e") == []


def test_incremental_updates_propose_what_a_fresh_tree_would() -> None:
    rng = np.random.default_rng(1)
    base = rng.integers(0, 20, 40).tolist()
    text = base + base[5:30] + rng.integers(0, 20, 30).tolist() + base[:25]
    old, later = [0, *base[10:35]], [0, *text[70:95]]
    live = SuffixProposer(6, max_tree_depth=10, max_cached_requests=4)
    live.finish("old", old, prompt_len=1)
    proposed = 0
    for end in range(20, len(text), 3):
        if end == 62:  # the cache changes while the request runs
            live.finish("later", later, prompt_len=1)
        fresh = SuffixProposer(6, max_tree_depth=10, max_cached_requests=4)
        fresh.finish("old", old, prompt_len=1)
        if end >= 62:
            fresh.finish("later", later, prompt_len=1)
        expected = fresh.propose(np.array(text[:end]), request_id="r")
        assert live.propose(np.array(text[:end]), request_id="r") == expected
        proposed += len(expected)
    assert proposed > 20  # the comparison saw drafts, not only empty proposals


def test_the_cache_matcher_tracks_the_longest_suffixes_present() -> None:
    tree = SuffixTree(5)
    tree.add_sequence([1, 2, 3, 4, 5, 6])
    matcher = Matcher(tree)
    matcher.extend([9, 9, 2, 3, 4])
    nodes = matcher.suffix_nodes()
    assert len(nodes) == 3  # "9 2 3 4" never occurred
    patterns = ([4], [3, 4], [2, 3, 4])
    assert [n is node_of(tree, p) for n, p in zip(nodes, patterns, strict=True)] == [True] * 3


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_speculative_tokens": 0}, "num_speculative_tokens must be >= 1"),
        ({"max_tree_depth": 1}, "suffix_decoding_max_tree_depth must be >= 2"),
    ],
)
def test_bad_settings_are_named(kwargs: dict, message: str) -> None:
    settings = {"num_speculative_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        SuffixProposer(**settings)
