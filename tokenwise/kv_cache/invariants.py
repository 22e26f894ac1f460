"""The block manager's bookkeeping, checked: every reference a pool counts is held by exactly
one table entry (or a state snapshot in flight), and nothing else holds a block.

Tests call it after every operation (`BlockManager.check_invariants`); explicit raises survive
`python -O`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from tokenwise.engine.block_pool import BlockPool
from tokenwise.kv_cache.managers import (
    NULL_BLOCK,
    KVCacheGroupManager,
    RecurrentStateManager,
)
from tokenwise.kv_cache.specs import CrossAttentionSpec


def check_pool_refs(pool: BlockPool, managers: Sequence[KVCacheGroupManager]) -> None:
    """Raise AssertionError unless `pool`'s ref counts are exactly what `managers` hold."""
    pool.check_invariants()
    refs: Counter[int] = Counter()
    for m in managers:
        if isinstance(m, RecurrentStateManager):
            refs.update(m.in_flight())
        for request_id, table in m.tables.items():
            held = [b for b in table if b != NULL_BLOCK]
            if len(set(held)) != len(held):
                raise AssertionError(f"request {request_id} holds a block twice")
            if m.num_registered.get(request_id, 0) > len(table):
                raise AssertionError(f"request {request_id} registered blocks it does not own")
            refs.update(held)
            if isinstance(m.spec, CrossAttentionSpec):
                cached = [b for b in held if pool.blocks[b].block_hash is not None]
                if cached:
                    raise AssertionError(f"cross blocks {cached} of {request_id} are in the cache")
    for block in pool.blocks:
        if block.ref_cnt != refs[block.block_id]:
            raise AssertionError(
                f"block {block.block_id}: ref count {block.ref_cnt} "
                f"but held by {refs[block.block_id]} tables"
            )
