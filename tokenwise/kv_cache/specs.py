"""What one layer keeps in the KV cache: its KV-cache spec.

Every layer with a cache declares one (`AttentionLayerBase.kv_cache_spec`). A spec says how the
layer's memory grows with a request and so which rules govern its blocks:

- `FullAttentionSpec`: every token's K/V, for the request's whole life (also MLA's latent,
  `MLAAttentionSpec`, which differs only in what a token row holds).
- `SlidingWindowSpec`: K/V of the last `sliding_window` tokens are all a query can see; blocks
  that fell out of the window are freed while the request runs.
- `CrossAttentionSpec`: the encoder's K/V that cross-attention reads, allocated whole at
  admission and never prefix-cached (it belongs to one request's encoder input).
- `RecurrentStateSpec`: a fixed-size state per request (Gated DeltaNet / Mamba layers: a
  convolution window and a recurrent matrix), however long the request. Its "blocks" are state
  slots from a pool of their own: one live slot per running request, and snapshots of the state
  at block boundaries that prefix caching, preemption and speculative rollback resume from.

Learned attention sinks (gpt-oss: one logit per head that joins every softmax) hold no memory,
so a layer with sinks has the spec of its window; likewise a logit soft-cap.

Two layers with equal specs can share one group's block tables (`layout.py`). `storage` is what
makes pages interchangeable between groups: the per-block shape of the layer's cache tensor and
its dtype; layers of different groups may then share one tensor. Specs are plain frozen data:
they hold no tensors and never change after start-up.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVCacheSpec:
    """One block of one layer: `block_size` tokens in `page_size_bytes` bytes.

    `storage` identifies the cache tensor's layout (its shapes for one and two blocks, and its
    dtype): layers whose storage is equal can use each other's tensors.
    """

    block_size: int
    page_size_bytes: int
    storage: tuple = ()

    #: Name of the kind, for logs and the benchmark (one manager class per kind).
    kind: ClassVar[str] = "full"
    #: Which pool the group's blocks come from: "kv" (token blocks) or "state" (state slots).
    pool: ClassVar[str] = "kv"

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.page_size_bytes < 0:
            raise ValueError(f"page_size_bytes must be >= 0, got {self.page_size_bytes}")

    def max_blocks_per_request(self, num_tokens: int, max_chunk_tokens: int) -> int:
        """Most blocks one request of `num_tokens` tokens holds at once, when every step
        computes at most `max_chunk_tokens` of them (the scheduler's token budget)."""
        return cdiv(num_tokens, self.block_size)

    def describe(self) -> str:
        return self.kind


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    kind: ClassVar[str] = "full"


@dataclass(frozen=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention: one latent row per token, kept like full attention."""

    kind: ClassVar[str] = "mla"


@dataclass(frozen=True)
class SlidingWindowSpec(KVCacheSpec):
    """A query at position p sees keys p - sliding_window + 1 .. p."""

    sliding_window: int = 0
    kind: ClassVar[str] = "sliding_window"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")

    def max_blocks_per_request(self, num_tokens: int, max_chunk_tokens: int) -> int:
        # A step's queries start at `computed`; the window reaches back `window - 1` tokens
        # before it, then the step adds up to `max_chunk_tokens` tokens (+1: a partial block
        # at each end).
        held = cdiv(self.sliding_window - 1 + max_chunk_tokens, self.block_size) + 1
        return min(cdiv(num_tokens, self.block_size), held)

    def describe(self) -> str:
        return f"sliding_window={self.sliding_window}"


@dataclass(frozen=True)
class CrossAttentionSpec(KVCacheSpec):
    """The encoder's K/V for cross-attention (allocated at admission, never cached)."""

    kind: ClassVar[str] = "cross"


@dataclass(frozen=True)
class RecurrentStateSpec(KVCacheSpec):
    """A per-request state of `page_size_bytes` (one slot); `block_size` is where snapshots
    are taken (every block boundary a step ends on), so hits line up with attention's."""

    kind: ClassVar[str] = "recurrent"
    pool: ClassVar[str] = "state"

    def max_blocks_per_request(self, num_tokens: int, max_chunk_tokens: int) -> int:
        return 1  # one live slot, whatever the length


def specs_for_groups(num_kv_cache_groups: int, block_size: int) -> tuple[KVCacheSpec, ...]:
    """The groups of a model described only by their count: none, self-attention, or self +
    cross (what tests and callers without a model's layout ask for)."""
    if num_kv_cache_groups not in (0, 1, 2):
        raise ValueError(
            f"num_kv_cache_groups must be 0 (no KV cache), 1 (self-attention) or 2 (self + "
            f"cross), got {num_kv_cache_groups}"
        )
    kinds = (FullAttentionSpec, CrossAttentionSpec)[:num_kv_cache_groups]
    return tuple(kind(block_size, 0) for kind in kinds)


__all__ = [
    "CrossAttentionSpec",
    "FullAttentionSpec",
    "KVCacheSpec",
    "MLAAttentionSpec",
    "RecurrentStateSpec",
    "SlidingWindowSpec",
    "cdiv",
    "check_pools",
    "specs_for_groups",
]


def check_pools(
    specs: Sequence[KVCacheSpec], block_size: int, num_blocks: int, num_state_slots: int
) -> None:
    """Raise ValueError unless the groups' `specs` fit one block manager's two pools: every
    group's blocks are `block_size` tokens (one pool), KV groups need blocks and recurrent
    groups state slots (and neither pool is given without its groups)."""
    for spec in specs:
        if spec.block_size != block_size:
            raise ValueError(
                f"a {spec.describe()} group has block_size {spec.block_size}, the manager "
                f"{block_size}: every group's blocks come from one pool"
            )
    kv_groups = sum(1 for spec in specs if spec.pool == "kv")
    if (num_blocks > 0) != (kv_groups > 0):
        raise ValueError(
            f"a block manager with {kv_groups} KV-cache groups needs "
            f"{'no' if not kv_groups else 'some'} blocks, got {num_blocks}"
        )
    if (num_state_slots > 0) != (len(specs) > kv_groups):
        raise ValueError(
            f"a block manager with {len(specs) - kv_groups} recurrent-state groups needs "
            f"{'no' if len(specs) == kv_groups else 'some'} state slots, got "
            f"{num_state_slots}"
        )
