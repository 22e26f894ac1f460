"""KV-cache events: what a cluster router reads to know which prefixes an engine holds.

Routers such as llm-d's and Dynamo's send a request to the engine that already caches most
of its prompt. They learn what each engine caches from a stream of events in vLLM's wire
format (msgspec structs, msgpack-encoded, array-like so a field is its position): a block
stored under its chain hash, blocks removed, everything cleared. The structs below spell the
fields and their order as vLLM does, so a subscriber written against vLLM decodes ours.

The block pool reports into a :class:`KVEventCollector` as it registers and evicts blocks;
the engine drains the collector once per step into one :class:`KVEventBatch`
(`tokenwise.distributed.kv_events` publishes it). Collecting is a list append, so the pool's
O(1) operations stay O(1).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import msgspec

#: The one storage medium tokenwise's blocks live in (vLLM's name for device memory).
MEDIUM_GPU = "GPU"

#: A block hash on the wire: vLLM sends ints or bytes; ours are sha256 digests (bytes).
ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Events of one engine step: when they were published and by which data-parallel rank."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the events; `tag=True` puts the class name first so a union decodes."""


class BlockStored(KVCacheEvent):
    """Consecutive full blocks of one request entered the prefix cache.

    `parent_block_hash` is the hash of the block before the first (None for a prompt's first
    block), so a router can extend the chain it already knows; `token_ids` are the blocks'
    tokens, `block_size` per block.
    """

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    """Blocks left the prefix cache (evicted for a new allocation, or dropped as untrusted)."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    """The whole prefix cache was reset."""


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class KVEventCollector:
    """The events of the current step, in the order the pool made them.

    Consecutive removals are merged into one `BlockRemoved` (an allocation that evicts many
    blocks then costs one event, not one per block).
    """

    def __init__(self) -> None:
        self._events: list[KVCacheEvent] = []

    def __len__(self) -> int:
        return len(self._events)

    def stored(
        self,
        block_hashes: list[bytes],
        parent_block_hash: bytes | None,
        token_ids: Sequence[int],
        block_size: int,
    ) -> None:
        self._events.append(
            BlockStored(
                block_hashes, parent_block_hash, list(token_ids), block_size, None, MEDIUM_GPU
            )
        )

    def removed(self, block_hash: bytes) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(block_hash)
        else:
            self._events.append(BlockRemoved([block_hash], MEDIUM_GPU))

    def cleared(self) -> None:
        # Whatever this step stored or removed before is moot once everything is gone.
        self._events = [AllBlocksCleared()]

    def take_batch(self, data_parallel_rank: int | None = None) -> KVEventBatch | None:
        """The step's events as one batch (None when there were none); the collector empties."""
        if not self._events:
            return None
        events, self._events = self._events, []
        return KVEventBatch(time.time(), events, data_parallel_rank)


__all__ = [
    "MEDIUM_GPU",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "ExternalBlockHash",
    "KVCacheEvent",
    "KVEventBatch",
    "KVEventCollector",
]
