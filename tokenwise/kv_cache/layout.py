"""KV-cache groups, and how their layers share one pool of blocks and a few tensors.

Layers with equal specs form a group: they share one block table per request, so one block
id gives every layer of the group the same token range. Each group has its own tables and its
own manager (`tokenwise.kv_cache.managers`), and all groups draw block ids from one pool.

How pages of different groups share that pool: a block id is a row in a set of cache tensors.
When the groups' pages are interchangeable (same per-block shape and dtype: the usual case, as
in Gemma 2/3 and gpt-oss, whose sliding and global layers have the same heads), the groups are
cut to an equal number of layers `G`, and tensor `j` is used by the `j`-th layer of *every*
group. A block id then belongs to exactly one group at a time, and a block a sliding-window
group frees is at once usable by the full-attention group: memory moves to whichever group
needs it, with no split decided up front. One block of the pool costs `G` pages.

Gemma-3-shaped, 30 sliding and 6 global layers: G = 6, five sliding groups and one global
group of 6 layers each, six tensors. A request at 16k tokens holds its 16k tokens in the
global group but only a window's worth in each sliding group.

When pages differ (layers of one model with different head sizes), each layer keeps a tensor
of its own, every block id costs one page of every layer, and only the block ids freed by one
group are reused by another: correct, and the memory saved is smaller (logged at start-up).
Cross-attention layers (encoder-decoder models) always keep their own tensors.

Recurrent-state layers (`RecurrentStateSpec`) do not share the block pool: a state is one
fixed-size slot per request, megabytes where an attention page is kilobytes, so their tensors
are indexed by slots of a pool of their own (`bytes_per_state_slot` each), sized apart.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from tokenwise.kv_cache.specs import (
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    SlidingWindowSpec,
    cdiv,
)

#: More groups cost the scheduler a manager call per request per step each; beyond this the
#: group size grows instead (the last group of a kind is then partly empty).
MAX_GROUPS = 8


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share block tables; `spec` is every one's spec."""

    spec: KVCacheSpec
    layer_names: tuple[str, ...]


@dataclass(frozen=True)
class KVCacheTensor:
    """One cache tensor of `num_blocks` pages; the layers in `shared_by` all use it (at most
    one per group, so no block id is ever used by two of them at once)."""

    page_size_bytes: int
    shared_by: tuple[str, ...]
    pool: str = "kv"  # "state": indexed by state slots, not KV blocks


@dataclass(frozen=True)
class KVCacheLayout:
    """The model's groups (attention kinds first, full attention first among them, then
    recurrent state, cross-attention last) and its cache tensors."""

    groups: tuple[KVCacheGroup, ...] = ()
    tensors: tuple[KVCacheTensor, ...] = ()
    shared: bool = False
    _group_of: dict[str, int] = field(default_factory=dict, compare=False, repr=False)
    _tensor_of: dict[str, int] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for g, group in enumerate(self.groups):
            for name in group.layer_names:
                if name in self._group_of:
                    raise ValueError(f"layer {name} is in two KV-cache groups")
                self._group_of[name] = g
        for t, tensor in enumerate(self.tensors):
            for name in tensor.shared_by:
                self._tensor_of[name] = t
        missing = set(self._group_of) - set(self._tensor_of)
        if missing:
            raise ValueError(f"layers {sorted(missing)} have a group but no cache tensor")

    @property
    def specs(self) -> tuple[KVCacheSpec, ...]:
        return tuple(group.spec for group in self.groups)

    @property
    def bytes_per_block(self) -> int:
        """What one block id of the KV pool costs, over every tensor indexed by it."""
        return sum(t.page_size_bytes for t in self.tensors if t.pool == "kv")

    @property
    def bytes_per_state_slot(self) -> int:
        """What one state slot costs, over every recurrent layer (0: no recurrent layer)."""
        return sum(t.page_size_bytes for t in self.tensors if t.pool == "state")

    @property
    def num_attention_groups(self) -> int:
        """Groups with token blocks of their own (not recurrent state, not cross-attention);
        they come first."""
        return sum(
            1
            for g in self.groups
            if g.spec.pool == "kv" and not isinstance(g.spec, CrossAttentionSpec)
        )

    def group_of(self, layer_name: str) -> int:
        return self._group_of[layer_name]

    def find_group(self, layer_name: str) -> int | None:
        """The layer's group, None for a layer without a cache."""
        return self._group_of.get(layer_name)

    def tensor_of(self, layer_name: str) -> int:
        return self._tensor_of[layer_name]

    def blocks_per_request(self, num_tokens: int, max_chunk_tokens: int) -> int:
        """KV blocks one request of `num_tokens` tokens holds at most, over every group but
        cross-attention (sized by the encoder, which a kind adds) and recurrent state (slots of
        the state pool)."""
        return sum(
            g.spec.max_blocks_per_request(num_tokens, max_chunk_tokens)
            for g in self.groups
            if not isinstance(g.spec, CrossAttentionSpec) and g.spec.pool == "kv"
        )

    def describe(self) -> str:
        kinds = ", ".join(f"{len(g.layer_names)} x {g.spec.describe()}" for g in self.groups)
        mode = "shared tensors" if self.shared else "a tensor per layer"
        return f"{len(self.groups)} KV-cache groups ({kinds}); {mode}"


def make_layout(layer_specs: Mapping[str, KVCacheSpec], hybrid: bool = True) -> KVCacheLayout:
    """Group `layer_specs` (layer name -> spec, in model order) and lay out their tensors.

    `hybrid=False` keeps every block of sliding-window layers (they group as full attention
    and read through their window only): the layout then depends on no layer's position, as
    pipeline stages, each laying out its own layers, need (the driver's block manager must
    see the same groups as every stage).
    """
    buckets: dict[KVCacheSpec, list[str]] = {}
    for name, spec in layer_specs.items():
        if not hybrid and isinstance(spec, SlidingWindowSpec):
            spec = FullAttentionSpec(spec.block_size, spec.page_size_bytes, spec.storage)
        buckets.setdefault(spec, []).append(name)
    cross = [(s, n) for s, n in buckets.items() if isinstance(s, CrossAttentionSpec)]
    states = [(s, n) for s, n in buckets.items() if s.pool == "state"]
    own = [
        (s, n)
        for s, n in buckets.items()
        if not isinstance(s, CrossAttentionSpec) and s.pool == "kv"
    ]
    # Full attention first: group 0's table then covers every token (the draft model's and
    # any reader's that needs the whole sequence).
    own.sort(key=lambda item: not isinstance(item[0], FullAttentionSpec))
    interchangeable = len({(s.storage, s.page_size_bytes) for s, _ in own}) == 1
    if len(own) > 1 and interchangeable:
        groups, tensors = _shared(own)
        shared = True
    else:
        groups = [KVCacheGroup(spec, tuple(names)) for spec, names in own]
        tensors = _per_layer(own)
        shared = False
    groups += [KVCacheGroup(spec, tuple(names)) for spec, names in states + cross]
    tensors += _per_layer(states, "state") + _per_layer(cross)
    return KVCacheLayout(tuple(groups), tuple(tensors), shared)


def _per_layer(
    buckets: list[tuple[KVCacheSpec, list[str]]], pool: str = "kv"
) -> list[KVCacheTensor]:
    return [
        KVCacheTensor(spec.page_size_bytes, (name,), pool)
        for spec, names in buckets
        for name in names
    ]


def _shared(
    buckets: list[tuple[KVCacheSpec, list[str]]],
) -> tuple[list[KVCacheGroup], list[KVCacheTensor]]:
    """Groups of `size` layers each (the smallest kind's count, grown until at most
    `MAX_GROUPS` groups), and `size` tensors, tensor j used by layer j of every group."""
    counts = [len(names) for _, names in buckets]
    size = min(counts)
    while sum(cdiv(c, size) for c in counts) > MAX_GROUPS:
        size += 1
    groups = [
        KVCacheGroup(spec, tuple(names[i : i + size]))
        for spec, names in buckets
        for i in range(0, len(names), size)
    ]
    page = buckets[0][0].page_size_bytes
    tensors = [
        KVCacheTensor(page, tuple(g.layer_names[j] for g in groups if j < len(g.layer_names)))
        for j in range(size)
    ]
    return groups, tensors


__all__ = ["MAX_GROUPS", "KVCacheGroup", "KVCacheLayout", "KVCacheTensor", "make_layout"]
