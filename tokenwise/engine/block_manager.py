"""Every request's block tables, and prefix caching, on top of :class:`BlockPool`.

The manager is the one owner of block tables: nothing else stores a request's blocks. The
scheduler asks it which prompt blocks are already cached (:meth:`BlockManager.get_computed_blocks`),
grows each request's table step by step (:meth:`BlockManager.allocate_slots`, which returns
only the blocks it appended), and may cut a table back (:meth:`BlockManager.truncate`, the
rollback speculative decoding needs). The runner learns each step's appended blocks from the
scheduler's output and mirrors them into its input batch; it never holds the manager's lists.

Tables come in KV-cache groups, one table per request per group, all from one pool:
:data:`SELF_ATTN` (the decoder's own K/V, prefix-cached) for every model with a cache, and
:data:`CROSS_ATTN` for encoder-decoder models (the encoder's K/V that cross-attention reads,
allocated whole when the request is admitted and never cached: it belongs to one request's
encoder input). The manager is pure bookkeeping: it never sees tensors.

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

#: KV-cache groups: indices into the per-group tables (and the scheduler output's block ids).
SELF_ATTN = 0
CROSS_ATTN = 1


#: `(offset, length, content hash)` of each image of a prompt (its placeholder tokens).
ImageSpans = Sequence[tuple[int, int, bytes]]


def hash_block_tokens(
    parent_hash: bytes,
    token_ids: Sequence[int],
    cache_salt: str | None = None,
    extra_keys: bytes = b"",
) -> bytes:
    """Chain hash of one full block.

    Including the parent hash makes the hash identify the whole prefix, not just this block's
    tokens.  Tokens are packed as little-endian int64 so the hash does not depend on the host.
    The salt only needs to enter the root block: every later hash inherits it via the chain.
    `extra_keys` is what the tokens alone do not say about the block's K/V: the content
    hashes of the images whose placeholder tokens it covers (placeholders of two images are
    the same token ids).
    """
    data = parent_hash
    if cache_salt:
        data += cache_salt.encode("utf-8")
    if extra_keys:
        data += b"\x00images:" + extra_keys
    data += struct.pack(f"<{len(token_ids)}q", *token_ids)
    return hashlib.sha256(data).digest()


def block_extra_keys(images: ImageSpans, start: int, end: int) -> bytes:
    """The hashes of the images with placeholder tokens in `[start, end)`, in order."""
    return b"".join(h for offset, length, h in images if offset < end and offset + length > start)


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
    # The CROSS_ATTN table (encoder-decoder models): allocated whole, never cached.
    cross_table: list[int] = field(default_factory=list)


class BlockManager:
    """Allocates KV cache blocks to requests and shares cached prompt prefixes between them."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        num_kv_cache_groups: int = 1,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if num_kv_cache_groups not in (0, 1, 2):
            raise ValueError(
                f"num_kv_cache_groups must be 0 (no KV cache), 1 (self-attention) or 2 (self + "
                f"cross), got {num_kv_cache_groups}"
            )
        if (num_blocks > 0) != (num_kv_cache_groups > 0):
            raise ValueError(
                f"a block manager with {num_kv_cache_groups} KV-cache groups needs "
                f"{'no' if num_kv_cache_groups == 0 else 'some'} blocks, got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.num_kv_cache_groups = num_kv_cache_groups
        self.pool = BlockPool(num_blocks)
        self._requests: dict[str, _RequestBlocks] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ------------------------------------------------------------------ queries

    def get_computed_blocks(
        self,
        request_id: str,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        images: ImageSpans = (),
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
            block_id = self.pool.lookup(self._block_hash(state, token_ids, i, cache_salt, images))
            if block_id is None:
                break
            hits.append(block_id)
        num_hit_tokens = len(hits) * self.block_size
        self.prefix_cache_queries += len(token_ids)
        self.prefix_cache_hits += num_hit_tokens
        return hits, num_hit_tokens

    def get_block_table(self, request_id: str, group: int = SELF_ATTN) -> tuple[int, ...]:
        """A copy of the request's table in `group` (empty for an unknown request).

        A copy, so that no caller can come to share, and silently edit, the manager's list.
        """
        state = self._requests.get(request_id)
        if state is None:
            return ()
        return tuple(state.cross_table if group == CROSS_ATTN else state.table)

    def num_blocks_of(self, request_id: str, group: int = SELF_ATTN) -> int:
        """Length of the request's table in `group` (0 for an unknown request)."""
        state = self._requests.get(request_id)
        if state is None:
            return 0
        return len(state.cross_table if group == CROSS_ATTN else state.table)

    def get_num_free_blocks(self) -> int:
        return self.pool.num_free

    def get_ref_count(self, block_id: int) -> int:
        """Number of request tables holding ``block_id`` (for tests and debugging)."""
        return self.pool.blocks[block_id].ref_cnt

    @property
    def usage(self) -> float:
        return self.pool.num_used / self.num_blocks if self.num_blocks else 0.0

    # ---------------------------------------------------------------- mutations

    def allocate_slots(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        num_new_tokens: int,
        new_computed_blocks: Sequence[int] = (),
        cache_salt: str | None = None,
        images: ImageSpans = (),
    ) -> list[int] | None:
        """Grow the request's table to cover computed + cached + new tokens.

        Returns the block ids appended to the table (the hits first, then fresh blocks; empty
        when the table already covers the tokens), or ``None`` when the pool is short.
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
        num_before = len(table)
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
                block_hash = self._block_hash(state, token_ids, i, cache_salt, images)
                self.pool.register(table[i], block_hash)
            state.num_registered = max(state.num_registered, num_full)
        return table[num_before:]

    def allocate_cross_slots(self, request_id: str, num_encoder_tokens: int) -> list[int] | None:
        """The request's CROSS_ATTN table for `num_encoder_tokens` rows; None when short.

        All-or-nothing, like `allocate_slots`. Fresh blocks only: never looked up in or
        registered with the prefix cache. Call it after `allocate_slots` for the same request,
        whose prefix-cache hits are then out of the free queue and cannot be evicted here.
        """
        if self.num_kv_cache_groups < 2:
            raise ValueError("this block manager has no cross-attention group")
        state = self._requests.get(request_id)
        if state is not None and state.cross_table:
            raise ValueError(f"request {request_id} already holds cross blocks")
        needed = -(-num_encoder_tokens // self.block_size)
        if needed > self.pool.num_free:
            return None
        if state is None:
            state = self._requests[request_id] = _RequestBlocks()
        state.cross_table = [self.pool.allocate() for _ in range(needed)]
        return list(state.cross_table)

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Cut the request's self-attention table back to the blocks `num_tokens` need.

        The rollback of tokens that were computed but are not kept (rejected speculative
        tokens): their K/V sits in the tail, which is freed (tail first, as in `free`). Only
        tokens outside the prefix cache can be rolled back: a registered block is full of
        known tokens that other requests may share, and the tokens rolled back are rewritten
        next step. Speculative tokens are never registered (`allocate_slots` registers only
        blocks full of the `token_ids` it is given, the known ones), so this never refuses
        them. Hashes memoised past `num_tokens` are forgotten: the tokens there will differ.
        """
        state = self._requests.get(request_id)
        if state is None:
            return
        bs = self.block_size
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        if num_tokens < state.num_registered * bs:
            raise ValueError(
                f"request {request_id}: cannot roll back to {num_tokens} tokens, into blocks "
                f"registered in the prefix cache ({state.num_registered * bs} tokens); only "
                "tokens not yet part of the known sequence (speculative ones) can be rolled back"
            )
        keep = -(-num_tokens // bs)
        for block_id in reversed(state.table[keep:]):
            self.pool.release(block_id)
        del state.table[keep:]
        del state.block_hashes[num_tokens // bs :]

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
        for block_id in reversed(state.cross_table):  # never cached: nothing to evict
            self.pool.release(block_id)
        for block_id in reversed(state.table):
            self.pool.release(block_id)
            if discard_cached and self.pool.blocks[block_id].ref_cnt == 0:
                self.pool.uncache(block_id)

    def reset_prefix_cache(self) -> bool:
        """Unregister every cached block; refused (False) while any block is in use."""
        return self.pool.reset()

    # ------------------------------------------------------------------ helpers

    def _block_hash(
        self,
        state: _RequestBlocks,
        token_ids: Sequence[int],
        index: int,
        cache_salt: str | None,
        images: ImageSpans = (),
    ) -> bytes:
        """Hash of block ``index``, extending the request's memoised chain as needed."""
        bs = self.block_size
        hashes = state.block_hashes
        while len(hashes) <= index:
            i = len(hashes)
            parent = hashes[-1] if hashes else ROOT_PARENT_HASH
            salt = cache_salt if i == 0 else None
            extra = block_extra_keys(images, i * bs, (i + 1) * bs) if images else b""
            hashes.append(hash_block_tokens(parent, token_ids[i * bs : (i + 1) * bs], salt, extra))
        return hashes[index]

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
            cross = state.cross_table
            if len(set(cross)) != len(cross) or set(cross) & set(state.table):
                raise AssertionError(f"request {request_id} holds a cross block twice")
            refs.update(cross)
            cached = [b for b in cross if self.pool.blocks[b].block_hash is not None]
            if cached:
                raise AssertionError(f"cross blocks {cached} of {request_id} are in the cache")
        for block in self.pool.blocks:
            if block.ref_cnt != refs[block.block_id]:
                raise AssertionError(
                    f"block {block.block_id}: ref count {block.ref_cnt} "
                    f"but held by {refs[block.block_id]} tables"
                )

    @property
    def num_cross_tables(self) -> int:
        """Requests holding cross blocks now (0 once every request has ended)."""
        return sum(1 for state in self._requests.values() if state.cross_table)
