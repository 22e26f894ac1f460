"""Layers that keep a fixed-size recurrent state per request instead of per-token K/V.

Gated DeltaNet (Qwen3.5 / Qwen3-Next), Mamba and their kin carry, per request, a state that
summarises every token so far. Model code stays token-wise: a mixer subclasses
`RecurrentStateLayer`, implements `mix(x, states, metadata)`, and the engine does the rest:
the layer's cache tensor holds one state per slot (`[num_slots + 1, state_numel]`, the last
slot a scratch row that padding reads and writes), the block manager gives each running
request a live slot (`kv_cache.managers.RecurrentStateManager`), and the runner starts that
slot from zeros or a prefix-cache snapshot before a step, snapshots it after, and rolls it back
after a speculative verification (`runner/recurrent_states.py`).

Per step the layer receives `RecurrentMetadata` from the forward context by its name: each
request's live slot, where its tokens lie in the flat stream, and whether to keep the state
after every token (a request verifying drafts: the runner then restores the state after the
last accepted token from `token_states`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenwise.attention.layer import AttentionLayerBase, metadata_for_layer
from tokenwise.config import EngineConfig
from tokenwise.forward_context import current_forward_context
from tokenwise.kv_cache.specs import KVCacheSpec, RecurrentStateSpec
from tokenwise.layer_registry import register_static_layer


@dataclass
class RecurrentMetadata:
    """One step's recurrent-state layout, shared by the layers of one group.

    `state_slots[i]` is request i's live slot (step order); its tokens are
    `query_start_loc[i]:query_start_loc[i + 1]` of the flat stream. Where `keep_token_states[i]`
    is set, each layer stores the state after each of those tokens in
    `token_states[layer_name][token]`. `graph_rows` / `graph_slots` are set only on the
    metadata a CPU graph is captured with (decode tokens only); its kernels read them.
    """

    state_slots: list[int]
    query_start_loc: list[int]
    keep_token_states: list[bool]
    token_states: dict[str, torch.Tensor] = field(default_factory=dict)
    # A replayed CPU graph's decode step (`runner/recurrent_graph.py`): int64 buffers of the
    # token rows and live slots, refilled before each replay; None when the step runs eagerly.
    graph_rows: torch.Tensor | None = None
    graph_slots: torch.Tensor | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.state_slots)


class RecurrentStateLayer(AttentionLayerBase):
    """A token mixer with a recurrent state of `state_numel` elements per request."""

    kv_cache_kind = "recurrent state"

    def __init__(self, state_numel: int, prefix: str, config: EngineConfig | None) -> None:
        super().__init__()
        if state_numel < 1:
            raise ValueError(f"state_numel must be >= 1, got {state_numel}")
        self.state_numel = state_numel
        self.layer_name = prefix
        if config is not None:
            register_static_layer(config, prefix, self)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """`num_blocks` state slots, plus the scratch slot padding rows use."""
        return (num_blocks + 1, self.state_numel)

    def spec_class(self) -> type[KVCacheSpec]:
        return RecurrentStateSpec

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Mix `x` (`[num_tokens, ...]`); outside the engine, one sequence from zeros."""
        ctx = current_forward_context()
        if ctx is None:
            states = torch.zeros(2, self.state_numel, dtype=x.dtype, device=x.device)
            md = RecurrentMetadata([0], [0, x.shape[0]], [False])
            return self.mix(x, states, md)
        md = metadata_for_layer(self.layer_name, ctx.attn_metadata)
        return self.mix(x, self.kv_cache[ctx.virtual_engine], md)

    def mix(self, x: torch.Tensor, states: torch.Tensor, md: RecurrentMetadata) -> torch.Tensor:
        """Run the recurrence over each request's tokens from `states[slot]`, leaving the
        state after its last token there (and after each token in `md.token_states` where
        kept)."""
        raise NotImplementedError


__all__ = ["RecurrentMetadata", "RecurrentStateLayer"]
