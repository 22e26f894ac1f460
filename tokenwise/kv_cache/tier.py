"""The second KV tier's store: block payloads by prefix-cache key, behind a small interface.

When the block pool evicts a cached block, its K/V need not be lost: the tier keeps a copy
under the block's prefix-cache key (its chain hash, plus the group suffix), and a later prefix
lookup that misses the pool loads it back (`kv_cache.tier_blocks`). The store knows nothing of
blocks or tensors' shapes: a payload is one flat uint8 CPU tensor, the block's bytes in every
cache tensor, and the store's contract is only

- `put(key, payload)`: keep it if it fits; never blocks the engine step (a store that writes
  somewhere slow does so in the background, and drops what it cannot queue);
- `get(key)`: the exact bytes that were put, or None: a payload that may be damaged is a
  miss, never served;
- `contains(key)`: cheap, so that evicting a block that is already stored costs no copy.

Two stores: `CPUMemoryTier` here (vLLM's "native" CPU offloading: host memory, pinned when the
engine runs on CUDA so copies to the device can be asynchronous), and `DiskTier`
(`tier_disk.py`, the default of a CPU engine, whose host memory *is* its KV cache: a directory
of checksummed files). Both evict least recently used payloads to stay under `capacity_bytes`.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class TierStats:
    """Counters of one store (cumulative, in blocks unless named bytes)."""

    stored: int = 0  # payloads accepted (a disk store: written and renamed into place)
    dropped: int = 0  # payloads not stored: queue full, or larger than the whole tier
    evicted: int = 0  # payloads removed to stay under the size cap
    corrupt: int = 0  # payloads that failed their check on reading (served as misses)
    hits: int = 0
    misses: int = 0
    bytes_used: int = 0


class KVTierStore(ABC):
    """Payloads (flat uint8 CPU tensors) by key, under a byte cap, least recently used out."""

    #: The tier's label in metrics and logs ("cpu", "disk").
    name: str = ""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"kv_offloading_size must be > 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.stats = TierStats()

    @abstractmethod
    def contains(self, key: bytes) -> bool: ...

    @abstractmethod
    def get(self, key: bytes) -> torch.Tensor | None:
        """The payload stored under `key` (verified), or None."""

    @abstractmethod
    def put(self, key: bytes, payload: torch.Tensor) -> None:
        """Store `payload` (the store owns it from now on); never blocks the caller."""

    @abstractmethod
    def clear(self) -> None:
        """Forget every payload (the weights changed: none of them is valid any more)."""

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every accepted `put` is readable; False if `timeout_s` ran out."""
        return True

    def close(self) -> None:
        """Stop background work (bounded: a store never hangs its engine's shutdown)."""
        return None


class CPUMemoryTier(KVTierStore):
    """Payloads kept in host memory (pinned when `pin`: the CUDA engine's tier).

    Nothing here can be truncated or half-written, so there is no checksum: a payload is a
    tensor the store owns from `put` on.
    """

    name = "cpu"

    def __init__(self, capacity_bytes: int, pin: bool = False) -> None:
        super().__init__(capacity_bytes)
        self.pin = pin
        self._items: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()

    def contains(self, key: bytes) -> bool:
        return key in self._items

    def get(self, key: bytes) -> torch.Tensor | None:
        with self._lock:
            payload = self._items.get(key)
            if payload is None:
                self.stats.misses += 1
                return None
            self._items.move_to_end(key)
            self.stats.hits += 1
            return payload

    def put(self, key: bytes, payload: torch.Tensor) -> None:
        size = payload.numel()
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return
            if size > self.capacity_bytes:
                self.stats.dropped += 1
                return
            while self.stats.bytes_used + size > self.capacity_bytes:
                _, old = self._items.popitem(last=False)
                self.stats.bytes_used -= old.numel()
                self.stats.evicted += 1
            if self.pin and not payload.is_pinned():
                payload = payload.pin_memory()
            self._items[key] = payload
            self.stats.bytes_used += size
            self.stats.stored += 1

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.stats.bytes_used = 0


__all__ = ["CPUMemoryTier", "KVTierStore", "TierStats"]
