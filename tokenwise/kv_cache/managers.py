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
- cross-attention blocks are allocated whole at admission and never prefix-cached.

A freed block that is registered in the prefix cache stays there (free but cached, evicted
least recently freed first), so a later request with the same prefix may still hit it.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenwise.engine.block_pool import BlockPool
from tokenwise.kv_cache.specs import (
    CrossAttentionSpec,
    KVCacheSpec,
    SlidingWindowSpec,
    cdiv,
    first_needed_token,
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
        return self.pool.lookup(block_hash + self._key_suffix)

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
        have = len(self.tables.get(request_id, ()))
        fresh = max(0, cdiv(num_tokens, self.block_size) - have - len(hits))
        revived = sum(1 for b in hits if b != NULL_BLOCK and self.pool.blocks[b].ref_cnt == 0)
        return fresh + revived

    def allocate(self, request_id: str, num_tokens: int, hits: Sequence[int]) -> list[int]:
        """Append `hits`, then fresh blocks up to `num_tokens`; the appended ids."""
        table = self.tables.setdefault(request_id, [])
        before = len(table)
        for block_id in hits:  # first: touching takes them out of reach of eviction below
            if block_id != NULL_BLOCK:
                self.pool.touch(block_id)
            table.append(block_id)
        for _ in range(cdiv(num_tokens, self.block_size) - len(table)):
            table.append(self.pool.allocate())
        return table[before:]

    def register(self, request_id: str, hashes: Sequence[bytes], num_full: int) -> None:
        """Offer the request's blocks full of known tokens to the prefix cache."""
        if not self.caching:
            return
        table = self.tables[request_id]
        start = self.num_registered.get(request_id, 0)
        for i in range(start, num_full):
            if table[i] != NULL_BLOCK:
                self.pool.register(table[i], hashes[i] + self._key_suffix)
        self.num_registered[request_id] = max(start, num_full)

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
        table = self.tables.get(request_id)
        if table is None:
            return
        skip = min(
            first_needed_token(self.spec, num_computed_tokens) // self.block_size, len(table)
        )
        done = self._num_skipped.get(request_id, 0)
        for i in range(skip - 1, done - 1, -1):  # tail first, as in `free`
            if table[i] != NULL_BLOCK:
                self.pool.release(table[i])
                table[i] = NULL_BLOCK
        self._num_skipped[request_id] = max(done, skip)

    def free(self, request_id: str, discard_cached: bool) -> None:
        self._num_skipped.pop(request_id, None)
        super().free(request_id, discard_cached)


def make_manager(
    spec: KVCacheSpec, group_id: int, pool: BlockPool, caching: bool
) -> KVCacheGroupManager:
    """The manager of `spec`'s kind."""
    cls = SlidingWindowManager if isinstance(spec, SlidingWindowSpec) else KVCacheGroupManager
    return cls(spec, group_id, pool, caching)


__all__ = ["NULL_BLOCK", "KVCacheGroupManager", "SlidingWindowManager", "make_manager"]
