"""Tests for the paged KV cache block manager and its prefix cache, with one KV-cache group.

`OneGroup` is the manager as a single-group model sees it: per-group results (one list per
group) unwrapped to group 0's list. The hybrid rules (several groups, sliding windows) are in
tests/engine/test_kv_cache_groups.py.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tokenwise.engine.block_manager import BlockManager, hash_block_tokens

BS = 4


class OneGroup(BlockManager):
    """A one-group manager: hits and appended blocks as group 0's list."""

    def get_computed_blocks(self, *args, **kwargs):  # type: ignore[override]
        hits, num_hit = super().get_computed_blocks(*args, **kwargs)
        assert len(hits) == 1
        return hits[0], num_hit

    def allocate_slots(self, rid, tokens, computed, new, hits=(), *args, **kwargs):  # type: ignore[override]
        out = super().allocate_slots(rid, tokens, computed, new, (list(hits),), *args, **kwargs)
        return None if out is None else out[0]


def admit(
    bm: BlockManager, rid: str, tokens: Sequence[int], salt: str | None = None
) -> list[int] | None:
    """Admit a new request the way the scheduler does: prefix lookup, then allocation."""
    hits, num_hit = bm.get_computed_blocks(rid, tokens, salt)
    return bm.allocate_slots(rid, tokens, 0, len(tokens) - num_hit, hits, salt)


def snapshot(bm: BlockManager, rids: Sequence[str]) -> tuple[int, list[list[int]], list[int]]:
    refs = [bm.get_ref_count(b) for b in range(bm.num_blocks)]
    return bm.get_num_free_blocks(), [list(bm.get_block_table(r)) for r in rids], refs


# ------------------------------------------------------------------------ basics


def test_free_with_discard_uncaches_only_blocks_nobody_else_holds() -> None:
    """After a failed forward pass the failed request's blocks are dropped from the prefix
    cache, except those another live request still holds (computed by an earlier step)."""
    bm = OneGroup(num_blocks=10, block_size=BS)
    prefix = list(range(8))
    assert admit(bm, "old", prefix + [50]) is not None  # registers the 2 prefix blocks
    assert admit(bm, "failed", prefix + [60, 61, 62, 63, 64]) is not None  # hits both
    bm.free("failed", discard_cached=True)
    hits, num_hit = bm.get_computed_blocks("probe", prefix + [60, 61, 62, 63, 64])
    assert num_hit == 8  # the shared prefix survives; the failed request's own block does not
    bm.free("probe")
    bm.free("old", discard_cached=True)
    assert bm.get_computed_blocks("probe2", prefix + [50])[1] == 0
    assert bm.get_num_free_blocks() == 10
    bm.check_invariants()


@pytest.mark.parametrize("num_tokens", [1, 3, 4, 5, 8, 9, 17])
def test_allocation_covers_ceil_tokens(num_tokens: int) -> None:
    bm = OneGroup(num_blocks=10, block_size=BS)
    table = admit(bm, "a", list(range(num_tokens)))
    assert table is not None
    assert len(table) == -(-num_tokens // BS)
    assert len(set(table)) == len(table)
    assert bm.get_num_free_blocks() == 10 - len(table)
    assert bm.usage == pytest.approx(len(table) / 10)
    bm.check_invariants()


def test_growth_across_boundary_adds_one_block_and_reports_only_it() -> None:
    bm = OneGroup(num_blocks=10, block_size=BS)
    tokens = list(range(4))
    table = admit(bm, "a", tokens)
    assert table is not None and len(table) == 1
    tokens.append(99)
    grown = bm.allocate_slots("a", tokens, 4, 1)
    assert grown is not None and len(grown) == 1 and grown[0] not in table
    assert bm.get_block_table("a") == (*table, *grown)
    # Filling the rest of block 1 needs no new block.
    tokens += [1, 2, 3]
    assert bm.allocate_slots("a", tokens, 5, 3) == []
    assert bm.num_blocks_of("a") == 2
    tokens.append(7)
    assert len(bm.allocate_slots("a", tokens, 8, 1) or []) == 1
    assert bm.num_blocks_of("a") == 3
    bm.check_invariants()


def test_the_table_is_owned_by_the_manager_alone() -> None:
    """What callers get is a copy: editing it cannot change what the manager holds."""
    bm = OneGroup(num_blocks=10, block_size=BS)
    new = bm.allocate_slots("a", list(range(8)), 0, 8)
    assert new is not None and len(new) == 2
    new.append(9)
    view = bm.get_block_table("a")
    assert isinstance(view, tuple) and len(view) == 2
    bm.check_invariants()


def test_truncate_rolls_back_speculative_tokens_only() -> None:
    """A rollback: blocks past the kept tokens go back to the pool; cached blocks are refused."""
    bm = OneGroup(num_blocks=10, block_size=BS)
    known = list(range(5))
    # 5 known tokens + 7 speculative ones computed: 3 blocks, only block 0 full of known ones.
    assert bm.allocate_slots("a", known, 0, 12) is not None
    full = bm.get_block_table("a")
    assert bm.get_computed_blocks("x", known + [0] * 8)[1] == 4
    bm.truncate("a", 6)  # 1 draft token accepted: blocks 0 and 1 cover 6 tokens
    assert bm.get_block_table("a") == full[:2]
    assert bm.get_num_free_blocks() == 8
    bm.check_invariants()
    # Regrowing registers each block once it is full of known tokens, under those tokens.
    known += [50, 51, 52, 53, 54, 55, 56]
    regrown = bm.allocate_slots("a", known, 6, 6)
    assert regrown is not None and len(regrown) == 1
    hits, n = bm.get_computed_blocks("b", known + [0])
    assert n == 12 and hits == [*full[:2], regrown[0]]
    bm.check_invariants()
    with pytest.raises(ValueError, match="into blocks registered in the prefix cache"):
        bm.truncate("a", 7)
    with pytest.raises(ValueError, match="num_tokens must be >= 0, got -1"):
        bm.truncate("a", -1)
    assert bm.get_block_table("a") == (*full[:2], regrown[0])


def test_not_enough_blocks_changes_nothing() -> None:
    bm = OneGroup(num_blocks=4, block_size=BS)
    assert admit(bm, "a", list(range(10))) is not None  # 3 blocks
    before = snapshot(bm, ["a", "b"])
    assert bm.allocate_slots("b", list(range(100, 109)), 0, 9) is None
    assert bm.allocate_slots("a", list(range(20)), 10, 10) is None
    assert snapshot(bm, ["a", "b"]) == before
    bm.check_invariants()


def test_failed_allocation_counts_revived_cached_hits() -> None:
    # Reviving a free cached block uses up a free block, so hits + fresh must fit together.
    bm = OneGroup(num_blocks=4, block_size=BS)
    prompt = list(range(9))
    assert admit(bm, "a", prompt) is not None
    bm.free("a")
    assert admit(bm, "x", [50, 51]) is not None  # 3 free blocks left, 2 of them cached
    hits, n = bm.get_computed_blocks("b", prompt + list(range(30, 40)))
    assert n == 8
    before = snapshot(bm, ["b", "x"])
    # needs 2 hits (revived) + 3 fresh = 5 > 3 free
    assert bm.allocate_slots("b", prompt, 0, 11, hits) is None
    assert snapshot(bm, ["b", "x"]) == before
    bm.check_invariants()


# ---------------------------------------------------------------- prefix caching


def test_prefix_hit_returns_shared_blocks() -> None:
    bm = OneGroup(num_blocks=16, block_size=BS)
    a_tokens = list(range(14))  # 3 full + 1 partial
    table_a = list(admit(bm, "a", a_tokens) or [])
    bm.free("a")
    b_tokens = a_tokens[:8] + [900, 901, 902, 903, 904]
    hits, n = bm.get_computed_blocks("b", b_tokens)
    assert hits == table_a[:2] and n == 2 * BS
    table_b = bm.allocate_slots("b", b_tokens, 0, len(b_tokens) - n, hits)
    assert table_b is not None and table_b[:2] == table_a[:2] and len(table_b) == 4
    assert all(bm.get_ref_count(b) == 1 for b in table_b)
    bm.check_invariants()


@pytest.mark.parametrize("length", [4, 8, 12])
def test_fully_cached_prompt_leaves_last_token(length: int) -> None:
    bm = OneGroup(num_blocks=16, block_size=BS)
    prompt = list(range(length))
    table_a = list(admit(bm, "a", prompt) or [])
    bm.free("a")
    hits, n = bm.get_computed_blocks("b", prompt)
    assert n == length - BS and hits == table_a[: length // BS - 1]
    assert n < len(prompt)
    table_b = bm.allocate_slots("b", prompt, 0, len(prompt) - n, hits)
    assert table_b is not None and len(table_b) == length // BS
    bm.check_invariants()


def test_cache_salt_separates_chains() -> None:
    bm = OneGroup(num_blocks=16, block_size=BS)
    prompt = list(range(9))
    assert admit(bm, "a", prompt, salt="alice") is not None
    assert bm.get_computed_blocks("b", prompt, "bob") == ([], 0)
    assert bm.get_computed_blocks("c", prompt) == ([], 0)
    assert bm.get_computed_blocks("d", prompt, "alice")[1] == 8
    assert hash_block_tokens(b"", prompt[:4], "x") != hash_block_tokens(b"", prompt[:4])


def test_caching_disabled_never_hits_and_counts_nothing() -> None:
    bm = OneGroup(num_blocks=16, block_size=BS, enable_caching=False)
    prompt = list(range(9))
    assert admit(bm, "a", prompt) is not None
    assert admit(bm, "b", prompt) is not None
    assert set(bm.get_block_table("a")).isdisjoint(bm.get_block_table("b"))
    bm.free("a")
    assert bm.get_computed_blocks("c", prompt) == ([], 0)
    assert bm.prefix_cache_queries == 0 and bm.prefix_cache_hits == 0
    bm.check_invariants()


def test_counters_are_exact() -> None:
    bm = OneGroup(num_blocks=16, block_size=BS)
    assert admit(bm, "a", list(range(10))) is not None  # miss: 10 queries, 0 hits
    assert admit(bm, "b", list(range(9))) is not None  # 9 queries, 8 hits
    assert admit(bm, "c", list(range(8))) is not None  # 8 queries, 4 hits (last token kept)
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (27, 12)


# ---------------------------------------------------------------------- eviction


def test_lru_eviction_prefers_uncached_then_oldest_freed() -> None:
    bm = OneGroup(num_blocks=6, block_size=BS)
    old = list(admit(bm, "old", [1] * 8) or [])  # 2 cached blocks (chain)
    new = list(admit(bm, "new", [2] * 8) or [])
    bm.free("old")
    bm.free("new")
    assert bm.get_num_free_blocks() == 6
    # 2 never-used blocks go first: no cached block is touched.
    first = bm.allocate_slots("x", [3] * 8, 0, 8)
    assert first is not None and set(first).isdisjoint(old + new)
    assert bm.get_computed_blocks("q1", [1] * 9)[1] == 8
    assert bm.get_computed_blocks("q2", [2] * 9)[1] == 8
    # Next: old chain, tail first (freed in reverse order).
    y = bm.allocate_slots("y", [4], 0, 1)
    assert y == [old[1]]
    assert bm.get_computed_blocks("q3", [1] * 9)[1] == 4  # head still hits
    z = bm.allocate_slots("z", [5], 0, 1)
    assert z == [old[0]]
    assert bm.get_computed_blocks("q4", [1] * 9) == ([], 0)
    assert bm.get_computed_blocks("q5", [2] * 9)[1] == 8  # newer chain untouched
    bm.check_invariants()


def test_hit_on_free_cached_block_protects_it_from_eviction() -> None:
    bm = OneGroup(num_blocks=4, block_size=BS)
    table_a = list(admit(bm, "a", list(range(8))) or [])
    table_b = list(admit(bm, "b", [50] * 8) or [])
    bm.free("a")
    bm.free("b")  # LRU order now: a's tail, a's head, b's tail, b's head
    tokens = list(range(8)) + [40, 41, 42]
    hits, n = bm.get_computed_blocks("c", tokens)
    table_c = bm.allocate_slots("c", tokens, 0, len(tokens) - n, hits)
    # The hits leave the free queue before the fresh block is taken, so the eviction victim
    # is b's tail rather than one of the hits.
    assert table_c == table_a + [table_b[1]]
    assert bm.get_computed_blocks("q", [50] * 9)[1] == 4
    bm.check_invariants()


def test_blocks_filled_by_decoding_become_cached() -> None:
    bm = OneGroup(num_blocks=8, block_size=BS)
    tokens = list(range(6))
    assert admit(bm, "a", tokens) is not None
    tokens += [6, 7]
    assert bm.allocate_slots("a", tokens, 6, 2) is not None
    tokens.append(8)
    assert bm.allocate_slots("a", tokens, 8, 1) is not None
    hits, n = bm.get_computed_blocks("b", tokens)
    assert n == 8 and hits == list(bm.get_block_table("a")[:2])


def test_only_computed_blocks_are_registered() -> None:
    # Chunked prefill: the full prompt is known, but only part of it is being computed.
    bm = OneGroup(num_blocks=8, block_size=BS)
    prompt = list(range(12))
    assert bm.allocate_slots("a", prompt, 0, 5) is not None
    assert bm.get_computed_blocks("b", prompt + [99])[1] == 4
    assert bm.allocate_slots("a", prompt, 5, 7) is not None
    assert bm.get_computed_blocks("c", prompt + [99])[1] == 12
    bm.check_invariants()


def test_reset_prefix_cache() -> None:
    bm = OneGroup(num_blocks=8, block_size=BS)
    prompt = list(range(9))
    assert admit(bm, "a", prompt) is not None
    assert bm.reset_prefix_cache() is False
    assert bm.get_computed_blocks("q", prompt)[1] == 8
    bm.free("a")
    assert bm.reset_prefix_cache() is True
    assert bm.get_computed_blocks("q2", prompt) == ([], 0)
    bm.check_invariants()


# ------------------------------------------------------------------------ sharing


def test_live_requests_share_prefix_blocks() -> None:
    bm = OneGroup(num_blocks=16, block_size=BS)
    prompt = list(range(10))
    table_a = list(admit(bm, "a", prompt) or [])
    table_b = list(admit(bm, "b", prompt) or [])
    assert table_b[:2] == table_a[:2] and table_b[2] != table_a[2]
    assert [bm.get_ref_count(b) for b in table_a] == [2, 2, 1]
    assert bm.get_num_free_blocks() == 16 - 4
    bm.free("a")
    assert [bm.get_ref_count(b) for b in table_b] == [1, 1, 1]
    assert bm.get_num_free_blocks() == 16 - 3
    bm.check_invariants()
    bm.free("b")
    bm.free("b")  # unknown id: no-op
    assert bm.get_num_free_blocks() == 16 and bm.usage == 0.0
    assert all(bm.get_ref_count(b) == 0 for b in range(16))
    bm.check_invariants()


# ---------------------------------------------------------------- stateful model

PREFIXES = [tuple(range(12)), tuple(range(100, 108)), (7,) * 10]


class BlockManagerMachine(RuleBasedStateMachine):
    """Random admissions, growth, forks and frees against a small pool.

    Beyond ``check_invariants`` it keeps its own model: each live request's tokens (hence
    expected table length) and what prefix each full block holds, so a prefix hit on a block
    whose contents differ from the request's tokens is caught.
    """

    def __init__(self) -> None:
        super().__init__()
        self.bm = OneGroup(num_blocks=16, block_size=BS)
        self.live: dict[str, tuple[list[int], str | None]] = {}
        self.freed: list[tuple[list[int], str | None]] = []
        self.contents: dict[int, tuple[str | None, tuple[int, ...]]] = {}
        self.queries = 0
        self.hits = 0
        self.next_id = 0

    def _new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def _record(self, rid: str, hit_blocks: Sequence[int]) -> None:
        tokens, salt = self.live[rid]
        table = self.bm.get_block_table(rid)
        for i in range(len(tokens) // BS):
            key = (salt, tuple(tokens[: (i + 1) * BS]))
            if table[i] in hit_blocks:
                assert self.contents[table[i]] == key, "prefix hit on a block with other tokens"
            else:
                self.contents[table[i]] = key

    def _admit(self, tokens: list[int], salt: str | None) -> None:
        rid = self._new_id()
        hits, n = self.bm.get_computed_blocks(rid, tokens, salt)
        assert n == len(hits) * BS and n < len(tokens)
        self.queries += len(tokens)
        self.hits += n
        before = snapshot(self.bm, list(self.live))
        table = self.bm.allocate_slots(rid, tokens, 0, len(tokens) - n, hits, salt)
        if table is None:
            assert snapshot(self.bm, list(self.live)) == before
            self.bm.free(rid)
            return
        assert table[: len(hits)] == hits
        self.live[rid] = (tokens, salt)
        self._record(rid, hits)

    @rule(
        prefix=st.sampled_from(PREFIXES),
        cut=st.integers(0, 12),
        tail=st.lists(st.integers(0, 3), max_size=8),
        salt=st.sampled_from([None, None, "s"]),
    )
    def add_request(
        self, prefix: tuple[int, ...], cut: int, tail: list[int], salt: str | None
    ) -> None:
        tokens = list(prefix[:cut]) + tail
        if tokens:
            self._admit(tokens, salt)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), count=st.integers(1, 2 * BS))
    def append_tokens(self, data: st.DataObject, count: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        tokens, salt = self.live[rid]
        grown = tokens + data.draw(st.lists(st.integers(0, 3), min_size=count, max_size=count))
        before = snapshot(self.bm, list(self.live))
        table = self.bm.allocate_slots(rid, grown, len(tokens), count, cache_salt=salt)
        if table is None:
            assert snapshot(self.bm, list(self.live)) == before
            return
        self.live[rid] = (grown, salt)
        self._record(rid, ())

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        tokens, salt = self.live[rid]
        self._admit(list(tokens), salt)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free_request(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.freed.append(self.live.pop(rid))
        self.bm.free(rid)

    @precondition(lambda self: self.freed)
    @rule(data=st.data())
    def readmit(self, data: st.DataObject) -> None:
        """Resume a preempted request: its freed blocks are the likeliest cache hits."""
        tokens, salt = data.draw(st.sampled_from(self.freed))
        self._admit(list(tokens), salt)

    @rule()
    def reset_cache(self) -> None:
        assert self.bm.reset_prefix_cache() == (not self.live)

    @invariant()
    def consistent(self) -> None:
        self.bm.check_invariants()
        expected = {rid: -(-len(t) // BS) for rid, (t, _) in self.live.items()}
        actual = {rid: len(self.bm.get_block_table(rid)) for rid in self.live}
        assert actual == expected
        held = Counter(b for rid in self.live for b in self.bm.get_block_table(rid))
        assert sum(held.values()) == sum(
            self.bm.get_ref_count(b) for b in range(self.bm.num_blocks)
        )
        assert all(self.bm.get_ref_count(b) == n for b, n in held.items())
        assert self.bm.get_num_free_blocks() == self.bm.num_blocks - len(held)
        assert (self.bm.prefix_cache_queries, self.bm.prefix_cache_hits) == (
            self.queries,
            self.hits,
        )

    def teardown(self) -> None:
        for rid in list(self.live):
            self.bm.free(rid)
        self.bm.check_invariants()
        assert self.bm.get_num_free_blocks() == self.bm.num_blocks
        assert all(self.bm.get_ref_count(b) == 0 for b in range(self.bm.num_blocks))


BlockManagerMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None
)
test_block_manager_state_machine = BlockManagerMachine.TestCase
