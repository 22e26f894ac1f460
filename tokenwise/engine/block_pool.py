"""The physical side of the paged KV cache: block ref counts, free lists and the hash registry.

Kept apart from :mod:`tokenwise.engine.block_manager` so that the per-request logic (tables,
hash chains, prefix matching) reads without the free-list mechanics in the way.  Every
operation here is O(1) because the scheduler touches the pool for every request every step.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from tokenwise.kv_cache.events import KVEventCollector
from tokenwise.kv_cache.tier_blocks import KVTierConnector


@dataclass(slots=True)
class KVBlock:
    """One fixed-size slot range of the KV cache.

    ``block_hash`` is set only while the block is *registered* in the prefix cache, so a
    non-None hash always means "some later request may find me by this hash".
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


class BlockPool:
    """Owns every :class:`KVBlock` and decides which free block a new allocation gets.

    Free blocks live in two queues so that cached contents survive as long as possible:
    uncached blocks are handed out first, and only when none is left is a cached free block
    evicted, least recently freed first (an ``OrderedDict`` gives O(1) append, pop-oldest
    and removal-by-id, the last one needed when a prefix hit revives a free cached block).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:  # 0: the empty pool of a model without a KV cache
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks: list[KVBlock] = [KVBlock(i) for i in range(num_blocks)]
        self._free_uncached: deque[int] = deque(range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self._hash_to_block: dict[bytes, int] = {}
        self.num_used = 0
        # Set when KV-cache events are on (`--kv-events-config`): evictions, drops and resets
        # are reported here; stores by the group managers, which know the blocks' tokens.
        self.events: KVEventCollector | None = None
        # Set when a second KV tier is on (`--kv-offloading-size`, `kv_cache/tier_blocks.py`):
        # evicted blocks are copied out to it, prefix lookups that miss here are loaded from it.
        self.tier: KVTierConnector | None = None

    @property
    def num_free(self) -> int:
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def num_free_cached(self) -> int:
        """Free blocks that still hold prefix-cache contents (evicted last)."""
        return len(self._free_cached)

    def block_states(self) -> bytes:
        """One byte per block: 2 in use, 1 free but cached, 0 free (the server's KV grid).

        O(blocks): for a periodic snapshot, never for every step.
        """
        return bytes(
            2 if b.ref_cnt else (1 if b.block_hash is not None else 0) for b in self.blocks
        )

    def lookup(self, block_hash: bytes) -> int | None:
        """Return the block registered under ``block_hash``, whether in use or free."""
        return self._hash_to_block.get(block_hash)

    def hit(self, block_hash: bytes) -> int | None:
        """`lookup` for a prefix lookup: with a KV tier, a miss here may be loaded from it,
        and the block is pinned until `end_lookup`."""
        if self.tier is None:
            return self._hash_to_block.get(block_hash)
        return self.tier.hit(block_hash)

    def end_lookup(self, hits: list[int]) -> int:
        """A prefix lookup is over: unpin its blocks; how many of `hits` the tier served."""
        return self.tier.end_lookup(hits) if self.tier is not None else 0

    def touch(self, block_id: int) -> None:
        """Take one more reference on a cached block (a prefix hit).

        A hit on a free block pulls it out of the eviction queue; that is why callers must
        count such blocks against the free budget before committing to an allocation.
        """
        block = self.blocks[block_id]
        if block.ref_cnt == 0:
            if block.block_hash is None:
                raise ValueError(f"block {block_id} is free and uncached; it cannot be a hit")
            del self._free_cached[block_id]
            self.num_used += 1
        block.ref_cnt += 1

    def allocate(self) -> int:
        """Hand out a block with no useful contents, evicting the LRU cached block if needed."""
        if self._free_uncached:
            block_id = self._free_uncached.popleft()
        elif self._free_cached:
            block_id, _ = self._free_cached.popitem(last=False)
            block = self.blocks[block_id]
            assert block.block_hash is not None
            if self.tier is not None:  # before anyone can write the block again
                self.tier.evicted(block_id, block.block_hash)
            del self._hash_to_block[block.block_hash]
            if self.events is not None:
                self.events.removed(block.block_hash)
            block.block_hash = None
        else:
            raise RuntimeError("no free KV cache block left")
        self.blocks[block_id].ref_cnt = 1
        self.num_used += 1
        return block_id

    def release(self, block_id: int) -> None:
        """Drop one reference; at zero the block becomes free but keeps its cached contents."""
        block = self.blocks[block_id]
        if block.ref_cnt <= 0:
            raise ValueError(f"block {block_id} released more often than referenced")
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            self.num_used -= 1
            if block.block_hash is None:
                self._free_uncached.append(block_id)
            else:
                self._free_cached[block_id] = None

    def register(self, block_id: int, block_hash: bytes) -> bool:
        """Publish a full block under its chain hash; whether it is newly in the cache.

        First registration wins: a duplicate block with an already-known hash, or a block
        that is itself already registered (a hit), is left as it is.  Deduplicating would
        mean rewriting live block tables, which buys little.
        """
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self._hash_to_block:
            return False
        block.block_hash = block_hash
        self._hash_to_block[block_hash] = block_id
        return True

    def uncache(self, block_id: int) -> None:
        """Unregister one free block (its contents are not to be trusted); no-op if uncached."""
        block = self.blocks[block_id]
        if block.ref_cnt != 0:
            raise ValueError(f"block {block_id} is in use; only a free block can be uncached")
        if block.block_hash is None:
            return
        del self._hash_to_block[block.block_hash]
        if self.events is not None:
            self.events.removed(block.block_hash)
        block.block_hash = None
        del self._free_cached[block_id]
        self._free_uncached.append(block_id)

    def reset(self) -> bool:
        """Forget every cached hash; refused while any block is in use (its table needs it)."""
        if self.num_used:
            return False
        for block_id in self._free_cached:
            self.blocks[block_id].block_hash = None
            self._free_uncached.append(block_id)
        self._free_cached.clear()
        self._hash_to_block.clear()
        if self.events is not None:
            self.events.cleared()
        if self.tier is not None:  # new weights: the tier's K/V is stale too
            self.tier.reset()
        return True

    def check_invariants(self) -> None:
        """Raise AssertionError on inconsistent bookkeeping (explicit raises survive ``-O``)."""

        def require(cond: bool, msg: str) -> None:
            if not cond:
                raise AssertionError(msg)

        uncached = set(self._free_uncached)
        require(len(uncached) == len(self._free_uncached), "duplicate in uncached free queue")
        require(not uncached & self._free_cached.keys(), "block in both free queues")
        used = 0
        for block in self.blocks:
            bid = block.block_id
            free = bid in uncached or bid in self._free_cached
            require(block.ref_cnt >= 0, f"block {bid} has negative ref count")
            require((block.ref_cnt > 0) != free, f"block {bid} is neither in use nor free once")
            used += block.ref_cnt > 0
            if bid in uncached:
                require(block.block_hash is None, f"uncached free block {bid} has a hash")
            if bid in self._free_cached:
                require(block.block_hash is not None, f"cached free block {bid} has no hash")
            if block.block_hash is not None:
                require(
                    self._hash_to_block.get(block.block_hash) == bid,
                    f"block {bid} carries a hash that is not registered to it",
                )
        for block_hash, bid in self._hash_to_block.items():
            require(self.blocks[bid].block_hash == block_hash, f"hash maps to wrong block {bid}")
        require(used == self.num_used, f"num_used {self.num_used} != counted {used}")
        require(self.num_free + used == self.num_blocks, "free + used != num_blocks")
