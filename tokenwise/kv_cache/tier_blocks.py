"""The second KV tier on the block pool: evicted blocks go out, prefix-lookup misses come in.

The connector sits between one `BlockPool` (bookkeeping) and the runner's cache tensors (the
K/V), in the engine's process, where the driver's runner lives. It works synchronously at the
two moments the pool changes hands, which is what makes it correct without any message to the
runner:

- **out**, when `BlockPool.allocate` evicts a free cached block: its bytes are copied out of
  every cache tensor *inside that call*, before `allocate` returns the block to anyone. A block
  id is written only by a forward pass of a request whose table holds it, and the new owner's
  table is built from this very return value, so no forward pass can have overwritten the
  block before the copy. The copy is one memcpy per cache tensor; the store's slow part (disk)
  runs on its own thread, so the step does not wait for it. A block already in the tier
  (it came from there) is not copied again.
- **in**, during a prefix lookup (`BlockPool.hit`): a key the pool misses but the store has is
  loaded into a fresh block, registered under its key, and from then on is an ordinary cached
  block that the rest of the lookup and the allocation treat like any other. Every block a
  lookup returns is pinned (one reference) until the lookup ends (`end_lookup`), so that
  loading block `i + 1` can never evict block `i` of the same prefix.

Which KV-group kinds this covers (`kv_cache/specs.py`): full attention and MLA (every block),
sliding window (its group's keys carry the group suffix, and only the blocks of the last
window are looked up), cross-attention (never cached: nothing to tier; its tensors are left
out of the payload), and recurrent state: a second connector drives the state pool, whose
"blocks" are snapshot slots keyed by the same chain hash (plus the group suffix) as the
attention blocks of the prefix they summarise, so a prefix hit finds both in the tier.

With a `TierLoads` (`kv_cache/tier_loads.py`, the engine's default) a key found only in the
store is not read during the lookup: `hit` reserves a block for it and hands the read to the
background loader, and the request waits for it while others keep stepping.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from tokenwise.kv_cache.tier import KVTierStore


class KVTierConnector:
    """Copies blocks between the cache tensors and a `KVTierStore`, driven by one pool.

    `tensors`: (cache tensor, its block dimension) for every tensor indexed by the pool's block
    ids; a block's payload is its slice of each, in order, as bytes (any dtype: fp8 caches
    travel as their bytes).
    """

    def __init__(self, pool: Any, store: KVTierStore, tensors: Sequence[tuple[torch.Tensor, int]]):
        if not tensors:
            raise ValueError("the KV tier needs at least one cache tensor")
        self.pool = pool
        self.store = store
        self.tensors = list(tensors)
        self._slices = []
        offset = 0
        for t, dim in self.tensors:
            one = t.select(dim, 0)
            nbytes = one.numel() * t.element_size()
            self._slices.append((offset, offset + nbytes, tuple(one.shape)))
            offset += nbytes
        self.block_bytes = offset
        self._pin = self.tensors[0][0].device.type == "cuda"
        self._pinned: dict[int, None] = {}  # blocks this lookup holds a reference on, in order
        self._loaded: set[int] = set()  # blocks loaded from the tier, not yet counted as hits
        self.num_loaded = 0  # blocks loaded in all (a lookup may load more than it hits)
        self.num_saved = 0  # blocks copied out to the store
        self.seconds = 0.0  # spent in the engine's thread: copies out and loads (benchmarks)
        # Set by `attach_kv_tier`: overlapped loads (None: a lookup reads the store itself).
        self.loads: Any = None

    # ---- copies -------------------------------------------------------------------------------

    def copy_out(self, block_id: int) -> torch.Tensor:
        """The block's bytes in every cache tensor, as one owned flat uint8 CPU tensor."""
        out = torch.empty(self.block_bytes, dtype=torch.uint8, pin_memory=self._pin)
        for (t, dim), (a, b, shape) in zip(self.tensors, self._slices, strict=True):
            out[a:b].view(t.dtype).view(shape).copy_(t.select(dim, block_id))
        return out

    def copy_in(self, block_id: int, payload: torch.Tensor) -> None:
        """Write a payload `copy_out` made back into block `block_id` of every cache tensor."""
        for (t, dim), (a, b, shape) in zip(self.tensors, self._slices, strict=True):
            t.select(dim, block_id).copy_(payload[a:b].view(t.dtype).view(shape))

    # ---- the pool's hooks ---------------------------------------------------------------------

    def evicted(self, block_id: int, key: bytes) -> None:
        """`block_id`, cached under `key`, is being evicted: keep its K/V in the tier."""
        self._loaded.discard(block_id)
        if not self.store.contains(key):
            start = time.perf_counter()
            self.store.put(key, self.copy_out(block_id))
            self.num_saved += 1
            self.seconds += time.perf_counter() - start

    def hit(self, key: bytes) -> int | None:
        """The block cached under `key`, from the pool or loaded from the tier; pinned until
        `end_lookup`. None: neither has it (or no block is free to load it into)."""
        pool = self.pool
        block_id = pool.lookup(key)
        if block_id is None:
            if self.loads is not None:  # read in the background; the request waits for it
                return self.loads.defer(self, key)
            if pool.num_free == 0 or not self.store.contains(key):
                return None
            start = time.perf_counter()
            payload = self.store.get(key)
            if payload is None or payload.numel() != self.block_bytes:
                return None
            block_id = pool.allocate()  # may evict (and save) an unpinned block
            self.copy_in(block_id, payload)
            self.seconds += time.perf_counter() - start
            pool.register(block_id, key)
            self._pinned[block_id] = None  # allocate's reference is the pin
            self._loaded.add(block_id)
            self.num_loaded += 1
            return block_id
        if block_id not in self._pinned:
            pool.touch(block_id)
            self._pinned[block_id] = None
        return block_id

    def finish_load(self, block_id: int, key: bytes, payload: torch.Tensor | None) -> bool:
        """A background read for `block_id` (reserved by `TierLoads.defer`) is back: write it
        in and register the block under `key`; False (nothing written) for a bad payload."""
        if payload is None or payload.numel() != self.block_bytes:
            return False
        start = time.perf_counter()
        self.copy_in(block_id, payload)
        self.seconds += time.perf_counter() - start
        if not self.pool.register(block_id, key):
            return False  # loaded meanwhile some other way: this copy stays uncached
        self._loaded.add(block_id)
        self.num_loaded += 1
        return True

    def end_lookup(self, hits: Sequence[int]) -> int:
        """Drop the lookup's pins (last pinned first: a prefix's head is freed last, as
        `BlockManager.free` does); how many of `hits` came from the tier (counted once)."""
        from_tier = sum(1 for b in hits if b in self._loaded)
        self._loaded.difference_update(hits)
        for block_id in reversed(self._pinned):
            self.pool.release(block_id)
        self._pinned.clear()
        return from_tier

    def reset(self) -> None:
        """The prefix cache was reset (new weights): nothing stored is valid any more."""
        self._loaded.clear()
        self.store.clear()

    def close(self) -> None:
        if self.loads is not None:
            self.loads.close()
        self.store.close()


def block_dim(layer: Any, block_size: int) -> int:
    """Which dimension of `layer`'s cache tensor indexes blocks (where the shapes for one and
    two blocks differ)."""
    one, two = layer.kv_cache_shape(1, block_size), layer.kv_cache_shape(2, block_size)
    for d, (a, b) in enumerate(zip(one, two, strict=True)):
        if a != b:
            return d
    raise ValueError(f"{type(layer).__name__}'s cache shape does not grow with its blocks")


__all__ = ["KVTierConnector", "block_dim"]
