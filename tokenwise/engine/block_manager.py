"""Per-request block tables and prefix caching on top of :class:`BlockPool`.

The manager is pure bookkeeping: it never sees tensors.  The scheduler asks it which prompt
blocks are already cached (:meth:`BlockManager.get_computed_blocks`), then grows each
request's block table step by step (:meth:`BlockManager.allocate_slots`).

Prefix caching identifies a *full* block by a hash chained over everything before it, so two
blocks with equal hashes hold the KV of the same token prefix and may be shared.  Only full
blocks are ever shared, hence a shared block is never appended to.
"""

from __future__ import annotations

import hashlib
import struct
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenwise.engine.block_pool import BlockPool

#: Parent "hash" of block 0.  Empty, so the root hash only depends on salt and tokens.
ROOT_PARENT_HASH = b""


def hash_block_tokens(
    parent_hash: bytes, token_ids: Sequence[int], cache_salt: str | None = None
) -> bytes:
    """Chain hash of one full block.

    Including the parent hash makes the hash identify the whole prefix, not just this block's
    tokens.  Tokens are packed as little-endian int64 so the hash does not depend on the host.
    The salt only needs to enter the root block: every later hash inherits it via the chain.
    """
    data = parent_hash
    if cache_salt:
        data += cache_salt.encode("utf-8")
    data += struct.pack(f"<{len(token_ids)}q", *token_ids)
    return hashlib.sha256(data).digest()


@dataclass
class _RequestBlocks:
    """What the manager remembers per request between scheduler steps.

    ``block_hashes`` may run ahead of the table (prefix lookup hashes the prompt before any
    block is allocated); it is kept so each block hash is computed once per request.
    ``num_registered`` is how many leading table blocks have already been offered to the
    prefix cache, which keeps registration O(newly full blocks) per call.
    """

    table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered: int = 0


class BlockManager:
    """Allocates KV cache blocks to requests and shares cached prompt prefixes between them."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks)
        self._requests: dict[str, _RequestBlocks] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ------------------------------------------------------------------ queries

    def get_computed_blocks(
        self, request_id: str, token_ids: Sequence[int], cache_salt: str | None = None
    ) -> tuple[list[int], int]:
        """Longest run of cached full blocks matching the start of ``token_ids``.

        At most ``len(token_ids) - 1`` tokens are reported as hits because the last prompt
        token must still run through the model to produce logits.  No references are taken:
        the caller passes the result to :meth:`allocate_slots`, which may still fail.
        """
        if not self.enable_caching:
            return [], 0
        state = self._requests.setdefault(request_id, _RequestBlocks())
        max_hit_blocks = max(0, (len(token_ids) - 1) // self.block_size)
        hits: list[int] = []
        for i in range(max_hit_blocks):
            block_id = self.pool.lookup(self._block_hash(state, token_ids, i, cache_salt))
            if block_id is None:
                break
            hits.append(block_id)
        num_hit_tokens = len(hits) * self.block_size
        self.prefix_cache_queries += len(token_ids)
        self.prefix_cache_hits += num_hit_tokens
        return hits, num_hit_tokens

    def get_block_table(self, request_id: str) -> list[int]:
        """The request's live table; an unknown request gets a fresh empty list."""
        state = self._requests.get(request_id)
        return state.table if state is not None else []

    def get_num_free_blocks(self) -> int:
        return self.pool.num_free

    def get_ref_count(self, block_id: int) -> int:
        """Number of request tables holding ``block_id`` (for tests and debugging)."""
        return self.pool.blocks[block_id].ref_cnt

    @property
    def usage(self) -> float:
        return self.pool.num_used / self.num_blocks

    # ---------------------------------------------------------------- mutations

    def allocate_slots(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        num_new_tokens: int,
        new_computed_blocks: Sequence[int] = (),
        cache_salt: str | None = None,
    ) -> list[int] | None:
        """Grow the request's table to cover computed + cached + new tokens.

        All-or-nothing: the budget check runs before anything is touched, so a ``None``
        leaves the scheduler free to preempt someone and retry.  Reviving a free cached hit
        consumes a free block just like a fresh allocation does, so both count against it.
        """
        bs = self.block_size
        state = self._requests.get(request_id)
        num_existing = len(state.table) if state is not None else 0
        if new_computed_blocks and num_computed_tokens != num_existing * bs:
            raise ValueError(
                "prefix-cache hits must directly follow the block-aligned computed tokens "
                f"({num_computed_tokens} computed, {num_existing} blocks of {bs})"
            )
        num_tokens = num_computed_tokens + len(new_computed_blocks) * bs + num_new_tokens
        num_required = -(-num_tokens // bs)
        num_fresh = max(0, num_required - num_existing - len(new_computed_blocks))
        num_revived = 0
        for block_id in new_computed_blocks:
            block = self.pool.blocks[block_id]
            if block.block_hash is None:
                raise ValueError(f"block {block_id} is no longer cached; redo the lookup")
            num_revived += block.ref_cnt == 0
        if num_fresh + num_revived > self.pool.num_free:
            return None

        if state is None:
            state = self._requests[request_id] = _RequestBlocks()
        table = state.table
        # Hits first: touching them takes them out of the free queue before allocation
        # below could evict them.
        for block_id in new_computed_blocks:
            self.pool.touch(block_id)
            table.append(block_id)
        for _ in range(num_fresh):
            table.append(self.pool.allocate())

        if self.enable_caching:
            num_full = min(num_tokens, len(token_ids)) // bs
            for i in range(state.num_registered, num_full):
                self.pool.register(table[i], self._block_hash(state, token_ids, i, cache_salt))
            state.num_registered = max(state.num_registered, num_full)
        return table

    def free(self, request_id: str, discard_cached: bool = False) -> None:
        """Drop all of a request's references.

        Tail first, so in the LRU queue a chain's head is the most recently freed block and
        the tail is evicted before it: evicting a head would orphan its whole chain.  Also
        call this for requests that only did a lookup, to drop their cached hashes.
        ``discard_cached`` also unregisters every block this leaves unreferenced, for when
        their contents cannot be trusted (a forward pass that failed half-way).
        """
        state = self._requests.pop(request_id, None)
        if state is None:
            return
        for block_id in reversed(state.table):
            self.pool.release(block_id)
            if discard_cached and self.pool.blocks[block_id].ref_cnt == 0:
                self.pool.uncache(block_id)

    def reset_prefix_cache(self) -> bool:
        """Unregister every cached block; refused (False) while any block is in use."""
        return self.pool.reset()

    # ------------------------------------------------------------------ helpers

    def _block_hash(
        self, state: _RequestBlocks, token_ids: Sequence[int], index: int, cache_salt: str | None
    ) -> bytes:
        """Hash of block ``index``, extending the request's memoised chain as needed."""
        bs = self.block_size
        hashes = state.block_hashes
        while len(hashes) <= index:
            i = len(hashes)
            parent = hashes[-1] if hashes else ROOT_PARENT_HASH
            salt = cache_salt if i == 0 else None
            hashes.append(hash_block_tokens(parent, token_ids[i * bs : (i + 1) * bs], salt))
        return hashes[index]

    def _check_other_holders(self, refs: Counter[int]) -> None:
        """Count blocks held outside the requests' own tables into `refs` (none here)."""

    def check_invariants(self) -> None:
        """Raise AssertionError if tables, ref counts, free queues or hashes disagree."""
        self.pool.check_invariants()
        refs: Counter[int] = Counter()
        for request_id, state in self._requests.items():
            if len(set(state.table)) != len(state.table):
                raise AssertionError(f"request {request_id} holds a block twice")
            if state.num_registered > len(state.table):
                raise AssertionError(f"request {request_id} registered blocks it does not own")
            refs.update(state.table)
        self._check_other_holders(refs)
        for block in self.pool.blocks:
            if block.ref_cnt != refs[block.block_id]:
                raise AssertionError(
                    f"block {block.block_id}: ref count {block.ref_cnt} "
                    f"but held by {refs[block.block_id]} tables"
                )
