"""Every request's block tables, and prefix caching, on top of :class:`BlockPool`.

The manager is the one owner of block tables: nothing else stores a request's blocks. The
scheduler asks it which prompt blocks are already cached (:meth:`BlockManager.get_computed_blocks`),
grows each request's table step by step (:meth:`BlockManager.allocate_slots`, which returns
only the blocks it appended), and may cut a table back (:meth:`BlockManager.truncate`, the
rollback speculative decoding needs). The runner learns each step's appended blocks from the
scheduler's output and mirrors them into its input batch; it never holds the manager's lists.

Tables come in KV-cache groups (`tokenwise.kv_cache.layout`: layers with equal specs), one
table per request per group, all from one pool, each group under its own manager
(`tokenwise.kv_cache.managers`): full attention keeps every block, a sliding window frees the
blocks that left it, cross-attention (encoder-decoder models: the encoder's K/V, group
:data:`CROSS_ATTN`) is allocated whole at admission and never cached. This class drives the
managers in lock-step: a prefix hit is the longest one every group can serve, an allocation
succeeds in every group or in none, and admission counts every group's blocks. It is pure
bookkeeping: it never sees tensors.

Prefix caching shares *full* blocks, identified by a hash chained over everything before them
(`kv_cache/hashing.py`), so a shared block is never appended to.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenwise.engine.block_pool import BlockPool
from tokenwise.kv_cache.hashing import ImageSpans, extend_chain, hash_block_tokens
from tokenwise.kv_cache.invariants import check_pool_refs
from tokenwise.kv_cache.managers import (
    KVCacheGroupManager,
    RecurrentStateManager,
    SlidingWindowManager,
    StateStep,
    make_manager,
)
from tokenwise.kv_cache.specs import (
    CrossAttentionSpec,
    KVCacheSpec,
    check_pools,
    specs_for_groups,
)

#: KV-cache groups: indices into the per-group tables (and the scheduler output's block ids).
#: Group 0 is full attention whenever the model has any; an encoder-decoder model's groups are
#: its decoder self-attention and, last, cross-attention.
SELF_ATTN = 0
CROSS_ATTN = 1

#: One list of block ids per KV-cache group (index = group), as the scheduler hands them on.
KVCacheBlocks = tuple[list[int], ...]


class BlockManager:
    """Allocates KV cache blocks to requests, group by group, and shares cached prefixes.

    `specs` gives each KV-cache group's spec, in group order (`KVCacheLayout.specs`); without
    it, `num_kv_cache_groups` (0, 1 or 2) names the plain layouts. Recurrent-state groups draw
    from a second pool of `num_state_slots` slots (`state_pool`).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        num_kv_cache_groups: int = 1,
        specs: Sequence[KVCacheSpec] | None = None,
        num_state_slots: int = 0,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if specs is None:
            specs = specs_for_groups(num_kv_cache_groups, block_size)
        check_pools(specs, block_size, num_blocks, num_state_slots)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks)
        self.state_pool = BlockPool(num_state_slots)
        self.managers = [
            make_manager(
                spec, g, self.pool if spec.pool == "kv" else self.state_pool, enable_caching
            )
            for g, spec in enumerate(specs)
        ]
        states = [m for m in self.managers if isinstance(m, RecurrentStateManager)]
        if len(states) > 1:
            raise ValueError(f"{len(states)} recurrent-state groups; one is supported")
        self._state = states[0] if states else None
        self._sliding = [m for m in self.managers if isinstance(m, SlidingWindowManager)]
        self._no_hits: KVCacheBlocks = tuple([] for _ in self.managers)
        self._num_registered: dict[str, int] = {}  # blocks offered to the prefix cache
        self._cross = [g for g, s in enumerate(specs) if isinstance(s, CrossAttentionSpec)]
        # Groups that grow with the request's own tokens (all but cross-attention).
        self._own = [m for m in self.managers if m.group_id not in self._cross]
        # The one manager of a model with one plain group (most models): a fast path.
        plain = len(self.managers) == 1 and type(self.managers[0]) is KVCacheGroupManager
        self._single = self.managers[0] if plain and not self._cross else None
        # Chain hashes per request, shared by every group (the same tokens in each). They may
        # run ahead of the tables: prefix lookup hashes the prompt before any block exists.
        self._hashes: dict[str, list[bytes]] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.prefix_cache_tier_hits = 0  # of those, tokens loaded from the second KV tier

    @property
    def num_kv_cache_groups(self) -> int:
        return len(self.managers)

    @property
    def specs(self) -> tuple[KVCacheSpec, ...]:
        return tuple(m.spec for m in self.managers)

    @property
    def has_recurrent_state(self) -> bool:
        """Whether some group keeps a recurrent state (the scheduler then aligns prompt
        chunks to blocks, where states are snapshotted)."""
        return self._state is not None

    # ------------------------------------------------------------------ queries

    def get_computed_blocks(
        self,
        request_id: str,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        images: ImageSpans = (),
    ) -> tuple[KVCacheBlocks, int]:
        """The longest cached prefix of ``token_ids`` that every group can serve: each
        group's blocks for it, and its length in tokens.

        At most ``len(token_ids) - 1`` tokens are reported as hits because the last prompt
        token must still run through the model to produce logits.  No references are taken:
        the caller passes the result to :meth:`allocate_slots`, which may still fail. Groups
        agree by shrinking the length until each accepts it (a sliding window accepts a
        length whose last window of blocks is cached, which a shorter length may not have).
        """
        empty: KVCacheBlocks = tuple([] for _ in self.managers)
        if not self.enable_caching or not self._own:
            return empty, 0
        limit = max(0, (len(token_ids) - 1) // self.block_size)
        hashes = self._block_hashes(request_id, token_ids, limit, cache_salt, images)
        length = limit
        hits = empty
        try:  # a KV tier pins what the lookup finds until it ends (`BlockPool.end_lookup`)
            while True:
                agreed = min(m.hit_length(hashes, length) for m in self._own)
                if agreed == length:
                    break
                length = agreed
            hits = tuple(
                [] if m.group_id in self._cross else m.hit_blocks(hashes, length)
                for m in self.managers
            )
        finally:
            from_tier = self.pool.end_lookup(hits[self._own[0].group_id])
            if self._state is not None:  # a snapshot loaded from the tier is pinned too
                self.state_pool.end_lookup(hits[self._state.group_id])
        tier = self.pool.tier
        if tier is not None and tier.loads is not None and tier.loads.lookup_deferred:
            return hits, length * self.block_size  # counted when the request looks again
        self.prefix_cache_queries += len(token_ids)
        self.prefix_cache_hits += length * self.block_size
        self.prefix_cache_tier_hits += from_tier * self.block_size
        return hits, length * self.block_size

    def get_block_table(self, request_id: str, group: int = SELF_ATTN) -> tuple[int, ...]:
        """A copy of the request's table in `group` (empty for an unknown request).

        A copy, so that no caller can come to share, and silently edit, the manager's list.
        Entries a sliding window dropped are `NULL_BLOCK`.
        """
        return tuple(self.managers[group].tables.get(request_id, ()))

    def num_blocks_of(self, request_id: str, group: int = SELF_ATTN) -> int:
        """Length of the request's table in `group` (0 for an unknown request)."""
        return len(self.managers[group].tables.get(request_id, ()))

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds over every group (what it costs the pool now)."""
        return sum(m.num_held(request_id) for m in self.managers)

    def max_blocks_per_request(self, num_tokens: int, max_chunk_tokens: int) -> int:
        """Most blocks a request of `num_tokens` tokens holds at once in the groups that grow
        with it (cross-attention is sized by the encoder and counted by its kind)."""
        return sum(
            m.spec.max_blocks_per_request(num_tokens, max_chunk_tokens)
            for m in self._own
            if m.pool is self.pool
        )

    def get_num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_free_state_slots(self) -> int:
        return self.state_pool.num_free

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
        new_computed_blocks: KVCacheBlocks | None = None,
        cache_salt: str | None = None,
        images: ImageSpans = (),
    ) -> KVCacheBlocks | None:
        """Grow the request's tables to cover computed + cached + new tokens.

        Returns, per group, the block ids appended to its table (the hits first, then fresh
        blocks; empty when the table already covers the tokens), or ``None`` when the pool
        is short. Before that, blocks no step from `num_computed_tokens` on can read (out of
        a sliding window) are freed. All-or-nothing otherwise: the budget check runs before
        anything is allocated, so a ``None`` leaves the scheduler free to preempt someone and
        retry. Reviving a free cached hit consumes a free block just like a fresh allocation
        does, so both count against it.
        """
        # Every request of every step passes here: the common case (a decode step, no hit, no
        # new block, one group) is kept to a few dictionary reads.
        bs = self.block_size
        if not new_computed_blocks and self._single is not None:
            m = self._single
            num_tokens = num_computed_tokens + num_new_tokens
            if m.blocks_needed(request_id, num_tokens, ()) > self.pool.num_free:
                return None
            appended: KVCacheBlocks = (m.allocate(request_id, num_tokens, ()),)
            self._register(request_id, token_ids, num_tokens, cache_salt, images)
            return appended
        if new_computed_blocks:
            hits = new_computed_blocks
            num_hit = max(len(hits[m.group_id]) for m in self._own if m.pool is self.pool)
            existing = self.num_blocks_of(request_id)
            if num_hit and num_computed_tokens != existing * bs:
                raise ValueError(
                    "prefix-cache hits must directly follow the block-aligned computed tokens "
                    f"({num_computed_tokens} computed, {existing} blocks of {bs})"
                )
        else:
            hits, num_hit = self._no_hits, 0
        num_tokens = num_computed_tokens + num_hit * bs + num_new_tokens
        for m in self._sliding:
            m.remove_skipped_blocks(request_id, num_computed_tokens)
        needed = state_needed = 0
        for m in self._own:
            n = m.blocks_needed(request_id, num_tokens, hits[m.group_id])
            if m.pool is self.pool:
                needed += n
            else:
                state_needed += n
        if needed > self.pool.num_free or state_needed > self.state_pool.num_free:
            return None
        if needed == state_needed == 0 and hits is self._no_hits:
            appended = tuple([] for _ in self.managers)  # every table covers the step already
        else:
            appended = tuple(
                [] if g in self._cross else m.allocate(request_id, num_tokens, hits[g])
                for g, m in enumerate(self.managers)
            )
        self._register(request_id, token_ids, num_tokens, cache_salt, images)
        return appended

    def _register(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_tokens: int,
        cache_salt: str | None,
        images: ImageSpans,
    ) -> None:
        """Offer the blocks this step fills with known tokens to the prefix cache."""
        if not self.enable_caching:
            return
        num_full = min(num_tokens, len(token_ids)) // self.block_size
        if num_full > self._num_registered.get(request_id, 0):
            hashes = self._block_hashes(request_id, token_ids, num_full, cache_salt, images)
            for m in self._own:
                m.register(request_id, hashes, num_full, num_tokens, token_ids)
            self._num_registered[request_id] = num_full

    def take_state_step(self, request_id: str) -> StateStep | None:
        """What the runner must do to the request's recurrent state around this step (start
        it from a snapshot or zeros, snapshot it after); None when nothing."""
        return self._state.steps.pop(request_id, None) if self._state else None

    def commit_step(self) -> None:
        """The scheduled step ran: publish its state snapshots (no-op without states)."""
        if self._state:
            self._state.commit_snapshots()

    def discard_step(self) -> None:
        """Forget a scheduled step that did not run (its snapshots were never written)."""
        if self._state:
            self._state.discard_step()

    def allocate_cross_slots(self, request_id: str, num_encoder_tokens: int) -> list[int] | None:
        """The request's cross-attention table for `num_encoder_tokens` rows; None when short.

        All-or-nothing, like `allocate_slots`. Fresh blocks only: never looked up in or
        registered with the prefix cache. Call it after `allocate_slots` for the same request,
        whose prefix-cache hits are then out of the free queue and cannot be evicted here.
        """
        if not self._cross:
            raise ValueError("this block manager has no cross-attention group")
        cross = self.managers[self._cross[0]]
        if cross.tables.get(request_id):
            raise ValueError(f"request {request_id} already holds cross blocks")
        if cross.blocks_needed(request_id, num_encoder_tokens, ()) > self.pool.num_free:
            return None
        return cross.allocate(request_id, num_encoder_tokens, ())

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Cut the request's own tables back to the blocks `num_tokens` need.

        The rollback of tokens that were computed but are not kept (rejected speculative
        tokens): their K/V sits in the tail, which is freed (tail first, as in `free`). Only
        tokens outside the prefix cache can be rolled back: a registered block is full of
        known tokens that other requests may share, and the tokens rolled back are rewritten
        next step. Speculative tokens are never registered (`allocate_slots` registers only
        blocks full of the `token_ids` it is given, the known ones), so this never refuses
        them. Hashes memoised past `num_tokens` are forgotten: the tokens there will differ.
        """
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        if not self._own or request_id not in self._own[0].tables:
            return
        bs = self.block_size
        registered = max(m.num_registered.get(request_id, 0) for m in self._own)
        if num_tokens < registered * bs:
            raise ValueError(
                f"request {request_id}: cannot roll back to {num_tokens} tokens, into blocks "
                f"registered in the prefix cache ({registered * bs} tokens); only "
                "tokens not yet part of the known sequence (speculative ones) can be rolled back"
            )
        for m in self._own:
            m.truncate(request_id, num_tokens)
        del self._hashes.get(request_id, [])[num_tokens // bs :]

    def free(self, request_id: str, discard_cached: bool = False) -> None:
        """Drop all of a request's references, in every group.

        Tail first, so in the LRU queue a chain's head is the most recently freed block and
        the tail is evicted before it: evicting a head would orphan its whole chain.  Also
        call this for requests that only did a lookup, to drop their cached hashes.
        ``discard_cached`` also unregisters every block this leaves unreferenced, for when
        their contents cannot be trusted (a forward pass that failed half-way).
        """
        self._hashes.pop(request_id, None)
        self._num_registered.pop(request_id, None)
        for m in reversed(self.managers):
            m.free(request_id, discard_cached)

    def reset_prefix_cache(self) -> bool:
        """Unregister every cached block; refused (False) while any block is in use."""
        return self.pool.reset()

    # ------------------------------------------------------------------ helpers

    def _block_hashes(
        self,
        request_id: str,
        token_ids: Sequence[int],
        count: int,
        cache_salt: str | None,
        images: ImageSpans = (),
    ) -> list[bytes]:
        """The request's first `count` chain hashes, extending its memoised chain as needed."""
        hashes = self._hashes.setdefault(request_id, [])
        return extend_chain(hashes, token_ids, count, self.block_size, cache_salt, images)

    def check_invariants(self) -> None:
        """Raise AssertionError if tables, ref counts, free queues or hashes disagree."""
        for pool in (self.pool, self.state_pool):
            check_pool_refs(pool, [m for m in self.managers if m.pool is pool])

    @property
    def num_cross_tables(self) -> int:
        """Requests holding cross blocks now (0 once every request has ended)."""
        return sum(len([t for t in self.managers[g].tables.values() if t]) for g in self._cross)


__all__ = [
    "CROSS_ATTN",
    "SELF_ATTN",
    "BlockManager",
    "ImageSpans",
    "KVCacheBlocks",
    "hash_block_tokens",
]
