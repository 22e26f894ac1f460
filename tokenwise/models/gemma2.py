"""Gemma 2 (and, through `GemmaVariant`, Gemma 3's text model), written token-wise.

What sets Gemma apart from the Llama decoder, and why each piece is here:
- Layers alternate between a sliding window and global attention. Each `Attention` gets its
  own window; the runner builds one metadata object per distinct window and the forward
  context hands each layer its own, so nothing in this file knows about it.
- Attention scores are soft-capped (`attn_logit_softcapping`, Gemma 2) and scaled by
  `query_pre_attn_scalar ** -0.5` instead of `head_dim ** -0.5`; the final logits are
  soft-capped too (`final_logit_softcapping`).
- Four norms per layer (before and after attention and MLP), all `1 + weight` RMSNorms, and the
  embeddings are multiplied by `sqrt(hidden_size)` (rounded to the activations' dtype, as HF).
- Gemma 3 adds an RMSNorm over every q/k head and gives sliding and global layers different
  RoPE bases (`rope_parameters` per layer type, or 4.x's `rope_local_base_freq`).
- Under pipeline parallelism a stage holds its layers only (`layers/pipeline.py`). Each layer
  adds its own output, so there is no deferred residual: a stage hands the next one its
  hidden states alone (`IntermediateTensors.residual` is None).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from tokenwise.attention.backends.softcap import soft_cap
from tokenwise.attention.layer import Attention
from tokenwise.config import EngineConfig
from tokenwise.layers import (
    QKVParallelLinear,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    get_rope_config,
)
from tokenwise.layers.layernorm import GemmaRMSNorm
from tokenwise.layers.pipeline import (
    PipelineForCausalLM,
    PipelineStack,
    only_on,
    stage_lm_head,
    stage_weights,
)
from tokenwise.layers.weight_utils import load_stacked_weights
from tokenwise.models.llama import LlamaForCausalLM, LlamaMLP

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class GemmaVariant:
    qk_norm: bool = False  # Gemma 3: RMSNorm over each q/k head before RoPE
    rope_per_layer_type: bool = False  # Gemma 3: sliding and global layers differ in RoPE


def gemma_layer_types(hf_config: Any) -> list[str]:
    """Each layer's attention type: the config's `layer_types`, or what older configs imply.

    Configs written before `layer_types` existed said it implicitly: Gemma 3 through
    `sliding_window_pattern` (every n-th layer global), Gemma 2 by alternating, sliding first.
    """
    num_layers = int(hf_config.num_hidden_layers)
    types = getattr(hf_config, "layer_types", None)
    if types is not None:
        return list(types)
    pattern = getattr(hf_config, "sliding_window_pattern", None)
    if pattern:
        return [FULL if (i + 1) % int(pattern) == 0 else SLIDING for i in range(num_layers)]
    return [SLIDING if i % 2 == 0 else FULL for i in range(num_layers)]


class GemmaAttention(nn.Module):
    def __init__(
        self,
        config: EngineConfig,
        variant: GemmaVariant,
        rotary_emb: RotaryEmbedding,
        layer_type: str,
        prefix: str,
    ) -> None:
        super().__init__()
        hf = config.model.hf_config
        self.head_dim = config.model.head_dim
        bias = bool(getattr(hf, "attention_bias", False))
        heads, kv_heads = int(hf.num_attention_heads), config.model.num_kv_heads
        self.qkv_proj = QKVParallelLinear(hf.hidden_size, self.head_dim, heads, kv_heads, bias)
        self.o_proj = RowParallelLinear(heads * self.head_dim, hf.hidden_size, bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_norm = GemmaRMSNorm(self.head_dim, hf.rms_norm_eps) if variant.qk_norm else None
        self.k_norm = GemmaRMSNorm(self.head_dim, hf.rms_norm_eps) if variant.qk_norm else None
        self.rotary_emb = rotary_emb
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            float(hf.query_pre_attn_scalar) ** -0.5,
            num_kv_heads=self.num_kv_heads,
            prefix=f"{prefix}.attn",
            config=config,
            sliding_window=config.model.sliding_window if layer_type == SLIDING else None,
            logits_soft_cap=getattr(hf, "attn_logit_softcapping", None),
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        q, k, v = self.qkv_proj(hidden_states).split(self.qkv_proj.output_sizes, dim=-1)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q.reshape(num_tokens, self.num_heads, self.head_dim))
            k = self.k_norm(k.reshape(num_tokens, self.num_kv_heads, self.head_dim))
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q.flatten(1), k.flatten(1), v))


class GemmaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: EngineConfig,
        variant: GemmaVariant,
        rotary_emb: RotaryEmbedding,
        layer_type: str,
        prefix: str,
    ) -> None:
        super().__init__()
        hf = config.model.hf_config
        self.self_attn = GemmaAttention(
            config, variant, rotary_emb, layer_type, f"{prefix}.self_attn"
        )
        act = getattr(hf, "hidden_activation", None) or hf.hidden_act
        self.mlp = LlamaMLP(hf.hidden_size, hf.intermediate_size, act, bias=False)
        size, eps = hf.hidden_size, hf.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        attn = self.self_attn(positions, self.input_layernorm(hidden_states))
        hidden_states = hidden_states + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden_states))
        return hidden_states + self.post_feedforward_layernorm(mlp)


class GemmaModel(PipelineStack):
    def __init__(self, config: EngineConfig, variant: GemmaVariant, prefix: str) -> None:
        super().__init__()
        mc = config.model
        hf = mc.hf_config
        if getattr(hf, "use_bidirectional_attention", False):
            raise NotImplementedError("Gemma with use_bidirectional_attention is not supported")
        self.embed_scale = float(hf.hidden_size) ** 0.5
        layer_types = gemma_layer_types(hf)
        # One RoPE table per distinct base; plain Gemma 2 shares one across all layers.
        rope_key = (lambda t: t) if variant.rope_per_layer_type else (lambda t: None)
        ropes: dict[str | None, RotaryEmbedding] = {}
        for layer_type in set(layer_types):
            key = rope_key(layer_type)
            if key not in ropes:
                theta, scaling = get_rope_config(hf, key)
                ropes[key] = RotaryEmbedding(mc.head_dim, mc.max_model_len, theta, scaling)
        self.rotary_embs = nn.ModuleList(ropes.values())

        def layer(i: int) -> GemmaDecoderLayer:
            kind = layer_types[i]
            return GemmaDecoderLayer(
                config, variant, ropes[rope_key(kind)], kind, f"{prefix}.layers.{i}"
            )

        stage = self.build_stage(len(layer_types), layer)
        self.embed_tokens = only_on(
            stage.is_first, lambda: VocabParallelEmbedding(hf.vocab_size, hf.hidden_size)
        )
        self.norm = only_on(stage.is_last, lambda: GemmaRMSNorm(hf.hidden_size, hf.rms_norm_eps))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings times `sqrt(hidden_size)`, rounded to the activations' dtype (as HF)."""
        hidden_states = self.embed_tokens(input_ids)
        return hidden_states * torch.tensor(self.embed_scale, dtype=hidden_states.dtype)


class Gemma2ForCausalLM(PipelineForCausalLM):
    supports_pp: ClassVar[bool] = True  # `GemmaModel` builds one stage's layers
    variant = GemmaVariant()
    stacked_params_mapping = LlamaForCausalLM.stacked_params_mapping

    def __init__(self, config: EngineConfig, prefix: str = "") -> None:
        super().__init__()
        hf = config.model.hf_config
        self.model = self.build_model(config, f"{prefix}.model" if prefix else "model")
        self.tie_word_embeddings = bool(getattr(hf, "tie_word_embeddings", True))
        self.lm_head, self._head_from_embedding = stage_lm_head(
            self.model, hf, self.tie_word_embeddings
        )
        self.final_logit_softcapping = getattr(hf, "final_logit_softcapping", None)

    def build_model(self, config: EngineConfig, prefix: str) -> nn.Module:
        """The decoder under the LM head (Gemma 4 builds its own; the head is shared)."""
        return GemmaModel(config, self.variant, prefix)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden_states)
        if self.final_logit_softcapping:
            logits = soft_cap(logits, float(self.final_logit_softcapping))
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF-named tensors in (this pipeline stage's only); q/k/v and gate/up go to their
        fused parameters."""
        return load_stacked_weights(self, self.stage_weights(weights), self.stacked_params_mapping)

    def stage_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterable[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors this pipeline stage loads: a tied head's own tensor never."""
        skip_head = self.tie_word_embeddings
        kept = ((n, t) for n, t in weights if not (skip_head and n == "lm_head.weight"))
        return stage_weights(self, kept, self._head_from_embedding)
