"""The attention layer and its one opaque custom op (docs/forward-context.md §5).

Model code calls `Attention.forward(q, k, v)` on a flat token stream and never sees batch
structure. The layer hands its tensors and *its name* to `tokenwise::unified_attention`; the
op's body looks the layer, its KV cache and this step's metadata up in the forward context.
Because the op takes only tensors and a string, `torch.compile` treats it as one opaque node and
cuts the graph there (piecewise compilation), while everything between attention calls compiles.

The op hands the backend's impl tensors (q, k, v, the layer's cache) and the step's metadata,
never the layer itself: the impl got its settings when it was built, so `attention.backends`
sits below this module and never imports it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tokenwise.attention.backends.cross_attention import EncoderDecoderAttentionImpl
from tokenwise.attention.backends.selector import get_attn_backend
from tokenwise.attention.backends.single_sequence import single_sequence_attention
from tokenwise.attention.utils import AttentionType
from tokenwise.config import EngineConfig
from tokenwise.forward_context import current_forward_context, get_forward_context
from tokenwise.kv_cache.specs import (
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    SlidingWindowSpec,
)
from tokenwise.layer_registry import register_static_layer


class AttentionLayerBase(nn.Module):
    """What the model runner needs of every layer that owns a paged cache.

    Layers differ in what they cache per token (K and V per KV head, or one MLA latent), so
    each answers the shape of its own cache; the runner sizes the pool and binds caches from
    that alone; each also declares its KV-cache spec (`kv_cache_spec`), by which the runner
    groups layers (`tokenwise.kv_cache.layout`) and the block manager picks each group's rules.
    """

    sliding_window: int | None = None
    layer_name: str = ""
    # What one cache row holds, for the KV memory report in the log.
    kv_cache_kind: str = "K/V"

    def __init__(self) -> None:
        super().__init__()
        self.kv_cache: list[torch.Tensor] = [torch.tensor([])]

    @property
    def needs_kv_cache(self) -> bool:
        """Whether the engine must allocate and bind a cache for this layer."""
        return True

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of this layer's cache tensor for `num_blocks` usable blocks."""
        raise NotImplementedError

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        """What one block of this layer's cache holds, and under which rules it lives."""
        return self.spec_class()(block_size, *self._page(block_size, dtype))

    def spec_class(self) -> type[KVCacheSpec]:
        return FullAttentionSpec

    def _page(self, block_size: int, dtype: torch.dtype) -> tuple[int, tuple]:
        """Bytes of one block, and the storage key (the cache's shapes for 1 and 2 blocks and
        its dtype) that says whose tensors this layer could share."""
        one, two = (tuple(self.kv_cache_shape(n, block_size)) for n in (1, 2))
        return (math.prod(two) - math.prod(one)) * dtype.itemsize, (one, two, str(dtype))


class Attention(AttentionLayerBase):
    """Multi-head / grouped-query attention over a paged KV cache.

    q is `[num_tokens, num_heads * head_size]`, k and v `[num_tokens, num_kv_heads * head_size]`.
    The KV cache is not a module buffer: the engine allocates it after measuring memory and binds
    it by layer name (`kv_cache[virtual_engine]`). `logits_soft_cap` (Gemma 2) caps every score
    as `cap * tanh(score / cap)` before the softmax, in every backend path.

    Without a forward context (a model used on its own, outside the engine) the tokens are
    treated as one causal sequence with no cache, which makes the model usable like a plain
    PyTorch module in tests and notebooks.

    `sinks` (gpt-oss, vLLM's name): a `[num_heads]` tensor of this rank's heads' sink logits,
    the model's parameter itself (read at every call, so it may be filled after construction).
    Each joins its head's softmax denominator with no value, in every backend path. A sink
    holds no memory: the KV-cache spec stays the layer's window's.

    `attn_type=AttentionType.ENCODER_ONLY` (BERT-style embedding models): bidirectional
    attention within each sequence of the step and no KV cache at all; `needs_kv_cache` is
    False, so the engine allocates and binds nothing for the layer. Its op still reads the
    step's metadata from the forward context, for where sequences start and end.
    `DECODER_NO_CACHE` is the same with causal attention: a decoder classifying whole prompts.

    Encoder-decoder models (`backends/cross_attention.py`): `ENCODER` is the encoder's
    bidirectional self-attention (no cache, like ENCODER_ONLY, over the encoders that run this
    step); `ENCODER_DECODER` is cross-attention, with queries from decoder tokens and keys and
    values from the encoder: `key`/`value` hold the encoder tokens of this step (none in steps
    that run no encoder) and are written once into the layer's cross cache, read every step.
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        prefix: str = "",
        config: EngineConfig | None = None,
        sliding_window: int | None = None,
        attn_type: str = AttentionType.DECODER,
        logits_soft_cap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        num_kv_heads = num_kv_heads or num_heads
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        attn_type = AttentionType(attn_type)
        if attn_type is not AttentionType.DECODER and sliding_window is not None:
            raise ValueError(
                f"{attn_type.value} attention is not causal; it takes no sliding window"
                if attn_type is not AttentionType.DECODER_NO_CACHE
                else "decoder_no_cache attention takes no sliding window (a classifier with a "
                "sliding-window config is not supported)"
            )
        if sinks is not None and attn_type is not AttentionType.DECODER:
            raise ValueError(f"{attn_type.value} attention takes no sinks (decoder layers only)")
        if sinks is not None and tuple(sinks.shape) != (num_heads,):
            raise ValueError(
                f"sinks must have one logit per head, shape ({num_heads},); got {tuple(sinks.shape)}"
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.layer_name = prefix
        self.attn_type = attn_type
        self.backend = get_attn_backend(config)
        if attn_type in (AttentionType.ENCODER, AttentionType.ENCODER_DECODER):
            if logits_soft_cap:
                raise ValueError(f"{attn_type.value} attention takes no logits_soft_cap")
            # The same cache layout as the backend's decoder layers (cross_attention.py).
            self.impl: Any = EncoderDecoderAttentionImpl(
                num_heads, head_size, scale, num_kv_heads, attn_type
            )
            self.kv_cache_kind = "cross K/V"
        else:
            self.impl = self.backend.get_impl_cls()(
                num_heads=num_heads,
                head_size=head_size,
                scale=scale,
                num_kv_heads=num_kv_heads,
                sliding_window=sliding_window,
                logits_soft_cap=logits_soft_cap,
                attn_type=self.attn_type,
            )
            self.impl.sinks = sinks
        if config is not None:
            register_static_layer(config, prefix, self)

    @property
    def needs_kv_cache(self) -> bool:
        """Whether the engine must allocate and bind a KV cache for this layer."""
        return self.attn_type in (AttentionType.DECODER, AttentionType.ENCODER_DECODER)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return tuple(
            self.backend.get_kv_cache_shape(
                num_blocks, block_size, self.num_kv_heads, self.head_size
            )
        )

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        page, storage = self._page(block_size, dtype)
        if self.attn_type is AttentionType.ENCODER_DECODER:
            return CrossAttentionSpec(block_size, page, storage)
        if self.sliding_window is not None:
            return SlidingWindowSpec(block_size, page, storage, self.sliding_window)
        return FullAttentionSpec(block_size, page, storage)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        # A ContextVar read cannot be traced, so compiled code assumes the engine's context
        # and calls the op, which the compiler keeps as one opaque node.
        if torch.compiler.is_compiling():
            return torch.ops.tokenwise.unified_attention(query, key, value, self.layer_name)
        ctx = current_forward_context()
        if ctx is not None:
            # Eager: the op's body, called directly. Through the dispatcher a custom op costs
            # tens of microseconds per call in Python wrappers, paid by every layer of every
            # step; here the layer is `self`, so not even the name lookup is needed.
            attn_metadata = metadata_for_layer(self.layer_name, ctx.attn_metadata)
            kv_cache = self.kv_cache[ctx.virtual_engine]
            return self.impl.forward(query, key, value, kv_cache, attn_metadata)
        if self.attn_type in (AttentionType.ENCODER, AttentionType.ENCODER_DECODER):
            return self.impl.forward(query, key, value, self.kv_cache[0], None)
        return single_sequence_attention(
            query,
            key,
            value,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            scale=self.scale,
            sliding_window=self.sliding_window,
            softcap=self.logits_soft_cap,
            causal=self.attn_type in (AttentionType.DECODER, AttentionType.DECODER_NO_CACHE),
            sinks=getattr(self.impl, "sinks", None),  # held by the impl, not a second parameter
        )

    def extra_repr(self) -> str:
        return (
            f"name={self.layer_name!r}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
            f"head_size={self.head_size}, sliding_window={self.sliding_window}, "
            f"attn_type={self.attn_type.value}"
            + (f", logits_soft_cap={self.logits_soft_cap}" if self.logits_soft_cap else "")
        )


def metadata_for_layer(layer_name: str, attn_metadata: Any) -> Any:
    """This layer's metadata: the runner passes one per layer name, tests may pass one."""
    if isinstance(attn_metadata, dict):
        return attn_metadata[layer_name]
    return attn_metadata


@torch.library.custom_op("tokenwise::unified_attention", mutates_args=())
def unified_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_name: str
) -> torch.Tensor:
    """Write this step's K/V into the paged cache and attend, for the layer named `layer_name`."""
    ctx = get_forward_context()
    layer: Attention = ctx.no_compile_layers[layer_name]
    attn_metadata = metadata_for_layer(layer_name, ctx.attn_metadata)
    kv_cache = layer.kv_cache[ctx.virtual_engine]
    return layer.impl.forward(query, key, value, kv_cache, attn_metadata)


@unified_attention.register_fake
def _unified_attention_fake(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_name: str
) -> torch.Tensor:
    return torch.empty_like(query)
