"""One manager per KV-cache group: the group's block tables under its spec's rules.

Every manager draws from the one `BlockPool` and keeps one table per request; the
`BlockManager` (`tokenwise.engine.block_manager`) drives all of them in lock-step, so a request
holds a table in every group. The rules that differ by spec:

- which cached blocks a prefix hit needs (`hit_length`): full attention needs every block of
  the prefix; a sliding window only the last window's worth before the hit point (earlier
  entries are `NULL_BLOCK`);
- which blocks a running request may drop (`remove_skipped_blocks`): none under full
  attention; under a sliding window, every block whose tokens all fell out of the window of
  the next step's first query;
- cross-attention blocks are allocated whole at admission and never prefix-cached;
- recurrent state (`RecurrentStateManager`) holds one live slot per running request, from a
  pool of state slots, and snapshots the state at block boundaries for prefix hits.

A freed block that is registered in the prefix cache stays there (free but cached, evicted
least recently freed first), so a later request with the same prefix may still hit it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenwise.engine.block_pool import BlockPool
from tokenwise.kv_cache.specs import (
    CrossAttentionSpec,
    KVCacheSpec,
    RecurrentStateSpec,
    SlidingWindowSpec,
    cdiv,
)

#: A table entry whose block was freed (fell out of a window) or never needed (before a
#: sliding-window prefix hit). The runner never reads it: windowed tables start after it.
NULL_BLOCK = -1


class KVCacheGroupManager:
    """The tables of one group (full attention, MLA: every block kept)."""

    def __init__(self, spec: KVCacheSpec, group_id: int, pool: BlockPool, caching: bool) -> None:
        self.spec = spec
        self.group_id = group_id
        self.pool = pool
        self.block_size = spec.block_size
        self.caching = caching and not isinstance(spec, CrossAttentionSpec)
        self.tables: dict[str, list[int]] = {}
        self.num_registered: dict[str, int] = {}
        # Group 0 registers plain chain hashes; other groups' copies of the same tokens live in
        # other blocks, so their registry keys carry the group.
        self._key_suffix = b"" if group_id == 0 else b"\x00group" + str(group_id).encode()

    # ---- prefix hits ------------------------------------------------------------------------

    def cached_block(self, block_hash: bytes) -> int | None:
        return self.pool.hit(block_hash + self._key_suffix)

    def hit_length(self, hashes: Sequence[bytes], limit: int) -> int:
        """The longest hit of at most `limit` blocks this group can serve."""
        n = 0
        while n < limit and self.cached_block(hashes[n]) is not None:
            n += 1
        return n

    def hit_blocks(self, hashes: Sequence[bytes], length: int) -> list[int]:
        """The table a hit of `length` blocks starts the request with (`hit_length` said so)."""
        return [self._cached(h) for h in hashes[:length]]

    def _cached(self, block_hash: bytes) -> int:
        block = self.cached_block(block_hash)
        if block is None:
            raise ValueError("a prefix hit names a block that is no longer cached; redo lookup")
        return block

    # ---- growing, shrinking -----------------------------------------------------------------

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free blocks no later step reads (none for full attention)."""

    def blocks_needed(self, request_id: str, num_tokens: int, hits: Sequence[int]) -> int:
        """Free blocks the allocation for `num_tokens` tokens takes: fresh ones, and hits that
        must be revived from the free queue."""
        table = self.tables.get(request_id)
        fresh = -(-num_tokens // self.block_size) - (len(table) if table else 0) - len(hits)
        if not hits:
            return fresh if fresh > 0 else 0
        blocks = self.pool.blocks
        revived = sum(1 for b in hits if b != NULL_BLOCK and blocks[b].ref_cnt == 0)
        return max(0, fresh) + revived

    def allocate(self, request_id: str, num_tokens: int, hits: Sequence[int]) -> list[int]:
        """Append `hits`, then fresh blocks up to `num_tokens`; the appended ids."""
        table = self.tables.get(request_id)
        if table is None:
            table = self.tables[request_id] = []
        elif not hits and -(-num_tokens // self.block_size) <= len(table):
            return []  # the table already covers the step (most decode steps)
        before = len(table)
        for block_id in hits:  # first: touching takes them out of reach of eviction below
            if block_id != NULL_BLOCK:
                self.pool.touch(block_id)
            table.append(block_id)
        for _ in range(cdiv(num_tokens, self.block_size) - len(table)):
            table.append(self.pool.allocate())
        return table[before:]

    def register(
        self,
        request_id: str,
        hashes: Sequence[bytes],
        num_full: int,
        num_tokens: int,
        token_ids: Sequence[int] = (),
    ) -> None:
        """Offer the request's blocks full of known tokens to the prefix cache (`num_full` of
        them; the step computes up to token `num_tokens`). With KV-cache events on, each run
        of newly cached blocks is reported with its tokens (`token_ids`: the request's)."""
        if not self.caching:
            return
        table = self.tables[request_id]
        start = self.num_registered.get(request_id, 0)
        events = self.pool.events
        run: list[int] = []  # indices of consecutive newly cached blocks, for one event
        for i in range(start, num_full):
            if table[i] != NULL_BLOCK:
                new = self.pool.register(table[i], hashes[i] + self._key_suffix)
                if events is not None and new:
                    if run and run[-1] != i - 1:
                        self._report_stored(run, hashes, token_ids)
                        run = []
                    run.append(i)
        if run:
            self._report_stored(run, hashes, token_ids)
        self.num_registered[request_id] = max(start, num_full)

    def _report_stored(
        self, run: list[int], hashes: Sequence[bytes], token_ids: Sequence[int]
    ) -> None:
        """One `BlockStored` for blocks `run` (consecutive indices) of a request's chain."""
        assert self.pool.events is not None
        first, bs, suffix = run[0], self.block_size, self._key_suffix
        self.pool.events.stored(
            [hashes[i] + suffix for i in run],
            hashes[first - 1] + suffix if first else None,
            token_ids[first * bs : (run[-1] + 1) * bs],
            bs,
        )

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Cut the table back to the blocks `num_tokens` tokens need (tail first)."""
        table = self.tables.get(request_id)
        if table is None:
            return
        keep = cdiv(num_tokens, self.block_size)
        for block_id in reversed(table[keep:]):
            if block_id != NULL_BLOCK:
                self.pool.release(block_id)
        del table[keep:]

    def free(self, request_id: str, discard_cached: bool) -> None:
        """Drop every reference of the request, tail first (a chain's head is then the most
        recently freed block and is evicted last)."""
        table = self.tables.pop(request_id, None)
        self.num_registered.pop(request_id, None)
        for block_id in reversed(table or ()):
            if block_id == NULL_BLOCK:
                continue
            self.pool.release(block_id)
            if discard_cached and self.pool.blocks[block_id].ref_cnt == 0:
                self.pool.uncache(block_id)

    def num_held(self, request_id: str) -> int:
        """Blocks the request holds in this group (not counting `NULL_BLOCK` entries)."""
        return sum(1 for b in self.tables.get(request_id, ()) if b != NULL_BLOCK)


class SlidingWindowManager(KVCacheGroupManager):
    """A sliding window: a request holds about a window of blocks, however long it grows."""

    spec: SlidingWindowSpec

    def __init__(self, spec: KVCacheSpec, group_id: int, pool: BlockPool, caching: bool) -> None:
        super().__init__(spec, group_id, pool, caching)
        # Blocks a query right after a hit point reads: those with a token in its window.
        self.window_blocks = cdiv(self.spec.sliding_window - 1, self.block_size)
        self._reach = self.spec.sliding_window - 1
        self._num_skipped: dict[str, int] = {}

    def hit_length(self, hashes: Sequence[bytes], limit: int) -> int:
        """The longest `m <= limit` whose last `window_blocks` blocks are cached (all of them
        when `m` is shorter): scanning back from `limit`, the first such run found."""
        run = 0
        for i in range(limit - 1, -1, -1):
            if self.cached_block(hashes[i]) is None:
                run = 0
                continue
            run += 1
            if run >= self.window_blocks:
                return i + run
        return run  # blocks 0 .. run - 1 are cached (run < window_blocks)

    def hit_blocks(self, hashes: Sequence[bytes], length: int) -> list[int]:
        start = max(0, length - self.window_blocks)
        return [NULL_BLOCK] * start + [self._cached(h) for h in hashes[start:length]]

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        # Blocks before the one holding token `computed - window + 1`, the earliest a query
        # from `computed` on reads. Every request of every step passes here: the no-op case
        # returns first.
        skip = (num_computed_tokens - self._reach) // self.block_size
        done = self._num_skipped.get(request_id, 0)
        if skip <= done:
            return
        table = self.tables.get(request_id)
        if table is None:
            return
        skip = min(skip, len(table))
        for i in range(skip - 1, done - 1, -1):  # tail first, as in `free`
            if table[i] != NULL_BLOCK:
                self.pool.release(table[i])
                table[i] = NULL_BLOCK
        self._num_skipped[request_id] = max(done, skip)

    def free(self, request_id: str, discard_cached: bool) -> None:
        self._num_skipped.pop(request_id, None)
        super().free(request_id, discard_cached)


#: `StateStep.init`: the live slot starts from zeros (a request with no prefix hit).
ZERO_STATE = -1


@dataclass
class StateStep:
    """What the runner does to a request's recurrent state around this step: before it,
    start the live slot from `init` (a snapshot slot, or `ZERO_STATE`; None: carry on); after
    it, copy the live state into slot `snapshot` (None: no snapshot)."""

    init: int | None = None
    snapshot: int | None = None


class RecurrentStateManager(KVCacheGroupManager):
    """One live state slot per running request, from the state pool.

    A state summarises every token before it, so a prefix hit needs one thing: a snapshot of
    the state right after the hit's last block. Snapshots are taken where a step ends on a
    block boundary of known tokens (the scheduler aligns prompt chunks to blocks, vLLM's
    "align" mode): the slot is chosen at scheduling, filled by the runner after the forward
    pass, and published in the prefix cache only then (`commit_snapshots`, from the
    scheduler's `update_from_output`), so no request can start from a slot not yet written.
    A snapshot is best-effort: none is taken when no slot is free. Preemption frees the live
    slot; the request resumes from a snapshot or from zeros and recomputes the rest.
    """

    def __init__(self, spec: KVCacheSpec, group_id: int, pool: BlockPool, caching: bool) -> None:
        super().__init__(spec, group_id, pool, caching)
        # This scheduling pass's instructions per request (taken by the scheduler's output).
        self.steps: dict[str, StateStep] = {}
        # Snapshot slots chosen this pass, (request, slot, registry key), and the snapshots
        # prefix hits start from: both referenced until the runner has copied them.
        self._pending: list[tuple[str, int, bytes]] = []
        self._held: list[int] = []

    def hit_length(self, hashes: Sequence[bytes], limit: int) -> int:
        for m in range(limit, 0, -1):
            if self.cached_block(hashes[m - 1]) is not None:
                return m
        return 0

    def hit_blocks(self, hashes: Sequence[bytes], length: int) -> list[int]:
        return [self._cached(hashes[length - 1])] if length else []

    def blocks_needed(self, request_id: str, num_tokens: int, hits: Sequence[int]) -> int:
        if request_id in self.tables:
            return 0
        return 1 + sum(1 for b in hits if self.pool.blocks[b].ref_cnt == 0)

    def allocate(self, request_id: str, num_tokens: int, hits: Sequence[int]) -> list[int]:
        if request_id in self.tables:
            return []
        init = ZERO_STATE
        for block_id in hits:  # the snapshot after the hit: kept until it is copied
            self.pool.touch(block_id)
            self._held.append(block_id)
            init = block_id
        live = self.pool.allocate()
        self.tables[request_id] = [live]
        self.steps[request_id] = StateStep(init=init)
        return [live]

    def register(
        self,
        request_id: str,
        hashes: Sequence[bytes],
        num_full: int,
        num_tokens: int,
        token_ids: Sequence[int] = (),
    ) -> None:
        """Choose a snapshot slot when this step ends exactly on a new full block."""
        bs = self.block_size
        if not self.caching or not num_full or num_tokens != num_full * bs:
            return
        key = hashes[num_full - 1] + self._key_suffix
        if self.pool.lookup(key) is not None or self.pool.num_free == 0:
            return
        slot = self.pool.allocate()
        self._pending.append((request_id, slot, key))
        self.steps.setdefault(request_id, StateStep()).snapshot = slot

    def in_flight(self) -> list[int]:
        """Slots referenced for the step in flight (chosen snapshots and hit sources)."""
        return [slot for _, slot, _ in self._pending] + self._held

    def commit_snapshots(self) -> None:
        """The runner has run the step: publish its snapshots, drop the copied-from ones."""
        self._end_step(publish=True)

    def discard_step(self) -> None:
        """The step never ran (or failed): its snapshots hold nothing; forget them."""
        self._end_step(publish=False)

    def _end_step(self, publish: bool) -> None:
        for _, slot, key in self._pending:
            if publish:
                self.pool.register(slot, key)
            self.pool.release(slot)
        for slot in self._held:
            self.pool.release(slot)
        self._pending.clear()
        self._held.clear()
        self.steps.clear()

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """A state cannot be cut back: the runner restores it from the step's per-token
        states (speculative rollback), so there is nothing to free here."""

    def free(self, request_id: str, discard_cached: bool) -> None:
        self.steps.pop(request_id, None)
        mine = [p for p in self._pending if p[0] == request_id]
        for entry in mine:  # a snapshot the request will not write
            self._pending.remove(entry)
            self.pool.release(entry[1])
        super().free(request_id, discard_cached)


def make_manager(
    spec: KVCacheSpec, group_id: int, pool: BlockPool, caching: bool
) -> KVCacheGroupManager:
    """The manager of `spec`'s kind."""
    if isinstance(spec, SlidingWindowSpec):
        return SlidingWindowManager(spec, group_id, pool, caching)
    if isinstance(spec, RecurrentStateSpec):
        return RecurrentStateManager(spec, group_id, pool, caching)
    return KVCacheGroupManager(spec, group_id, pool, caching)


__all__ = [
    "NULL_BLOCK",
    "ZERO_STATE",
    "KVCacheGroupManager",
    "RecurrentStateManager",
    "SlidingWindowManager",
    "StateStep",
    "make_manager",
]
