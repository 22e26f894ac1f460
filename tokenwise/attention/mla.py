"""The multi-head latent attention layer and its opaque custom op (DeepSeek-V2/V3).

Same pattern as `Attention`: the model calls `MLAAttention.forward(q, kv_c, k_pe,
kv_b_weight)` on a flat token stream; the layer hands its tensors and *its name* to
`tokenwise::mla_attention`, whose body looks the layer, its latent cache and this step's
metadata up in the forward context and calls the impl (`backends/mla_backend.py`) with tensors
only. The projections around it (q, the latent `kv_a_proj_with_mqa`, its norm, rotary, o_proj)
stay in the model; `kv_b_proj`'s weight is passed in on each call, because prefill expands the
latent with it and decode folds it into the query and the output.

What it caches per token and layer is `kv_lora_rank + qk_rope_head_dim` elements, not
`2 * heads * head_dim`: that is the point of MLA, and why its cache shape differs from the
other layers' (the runner asks every layer for its own).
"""

from __future__ import annotations

import torch

from tokenwise.attention.backends.mla_backend import (
    MLAHeadDims,
    MLAImpl,
    mla_kv_cache_shape,
    mla_single_sequence,
)
from tokenwise.attention.layer import AttentionLayerBase, metadata_for_layer
from tokenwise.config import EngineConfig
from tokenwise.forward_context import get_forward_context, is_forward_context_available
from tokenwise.kv_cache.specs import KVCacheSpec, MLAAttentionSpec
from tokenwise.layer_registry import register_static_layer


class MLAAttention(AttentionLayerBase):
    """Attention over a paged latent cache `[blocks + 1, block_size, kv_lora_rank + rope]`.

    Inputs per token: q `[heads * (qk_nope + qk_rope)]` (rope part rotated), the normalised
    latent `kv_c [kv_lora_rank]` and the rotated shared key part `k_pe [qk_rope]`. Output:
    `[heads * v_head_dim]`, before `o_proj`. Without a forward context the tokens are one
    causal sequence with no cache, as for `Attention`.
    """

    kv_cache_kind = "MLA latent"

    def __init__(
        self,
        dims: MLAHeadDims,
        scale: float,
        prefix: str = "",
        config: EngineConfig | None = None,
    ) -> None:
        super().__init__()
        self.dims = dims
        self.scale = scale
        self.layer_name = prefix
        self.sliding_window = None
        self.impl = MLAImpl(dims, scale)
        if config is not None:
            register_static_layer(config, prefix, self)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return mla_kv_cache_shape(num_blocks, block_size, self.dims)

    def spec_class(self) -> type[KVCacheSpec]:
        return MLAAttentionSpec

    def forward(
        self,
        q: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        kv_b_weight: torch.Tensor,
    ) -> torch.Tensor:
        # A ContextVar read cannot be traced, so compiled code assumes the engine's context.
        if not torch.compiler.is_compiling() and not is_forward_context_available():
            return mla_single_sequence(q, kv_c, k_pe, kv_b_weight, self.dims, self.scale)
        out_features = self.dims.num_heads * self.dims.v_head_dim
        return torch.ops.tokenwise.mla_attention(
            q, kv_c, k_pe, kv_b_weight, self.layer_name, out_features
        )

    def extra_repr(self) -> str:
        d = self.dims
        return (
            f"name={self.layer_name!r}, heads={d.num_heads}, kv_lora_rank={d.kv_lora_rank}, "
            f"qk_nope={d.qk_nope_head_dim}, qk_rope={d.qk_rope_head_dim}, v_head={d.v_head_dim}"
        )


@torch.library.custom_op("tokenwise::mla_attention", mutates_args=())
def mla_attention(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_b_weight: torch.Tensor,
    layer_name: str,
    out_features: int,
) -> torch.Tensor:
    """Write this step's latents into the layer's cache and attend, for `layer_name`.

    `out_features` (heads * v_head_dim) is not needed here; it lets the fake implementation
    give the output's shape from the arguments alone when the op is traced.
    """
    ctx = get_forward_context()
    layer: MLAAttention = ctx.no_compile_layers[layer_name]
    attn_metadata = metadata_for_layer(layer_name, ctx.attn_metadata)
    cache = layer.kv_cache[ctx.virtual_engine]
    return layer.impl.forward(q, kv_c, k_pe, kv_b_weight, cache, attn_metadata)


@mla_attention.register_fake
def _mla_attention_fake(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_b_weight: torch.Tensor,
    layer_name: str,
    out_features: int,
) -> torch.Tensor:
    return q.new_empty(q.shape[0], out_features)
