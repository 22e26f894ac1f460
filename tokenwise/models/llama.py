"""The Llama decoder, written token-wise; Mistral, Qwen2 and Qwen3 are small variations of it.

The model sees one flat stream of tokens (every sequence of the step, concatenated) plus each
token's position. It never learns where one sequence ends: the attention layer gets that from
the forward context. That is what keeps this file free of batching and cache bookkeeping.

What differs between the Llama-family architectures is captured by `DecoderVariant` (biases,
per-head q/k norms); a subclass only overrides `decoder_variant`, and an MoE model also
`make_mlp` (which layers get experts instead of the dense MLP).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from tokenwise.attention.layer import Attention
from tokenwise.attention.utils import AttentionType
from tokenwise.config import EngineConfig
from tokenwise.layers import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    get_act_and_mul,
    get_rope_config,
)
from tokenwise.layers.pipeline import (
    IntermediateTensors,
    PipelineForCausalLM,
    PipelineStack,
    held_by_stage,
    only_on,
    stage_lm_head,
)
from tokenwise.layers.weight_utils import load_stacked_weights


@dataclass(frozen=True)
class DecoderVariant:
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each q/k head before RoPE
    # DECODER_NO_CACHE for a decoder run as a classifier (whole prompts, no KV cache).
    attn_type: AttentionType = AttentionType.DECODER


# (config, layer index, module path of the block) -> the layer's feed-forward block, or None for
# the dense LlamaMLP. MoE models use it to put experts in some or all layers.
MlpFactory = Callable[[EngineConfig, int, str], "nn.Module | None"]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def layer_sliding_window(config: EngineConfig, layer_idx: int) -> int | None:
    """The window of one layer: configs with `layer_types` (Qwen2/3) slide only on some layers.

    Qwen configs written before `layer_types` existed say the same with `max_window_layers`:
    layers from that index on slide, the ones below it attend globally.
    """
    window = config.model.sliding_window
    hf = config.model.hf_config
    if window is None:
        return None
    layer_types = getattr(hf, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    max_window_layers = getattr(hf, "max_window_layers", None)
    if max_window_layers is not None and getattr(hf, "use_sliding_window", False):
        return window if layer_idx >= int(max_window_layers) else None
    return window


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: EngineConfig,
        variant: DecoderVariant,
        rotary_emb: RotaryEmbedding,
        layer_idx: int,
        prefix: str,
    ) -> None:
        super().__init__()
        hf = config.model.hf_config
        self.num_heads = int(hf.num_attention_heads)
        self.num_kv_heads = config.model.num_kv_heads
        self.head_dim = config.model.head_dim
        self.qkv_proj = QKVParallelLinear(
            hf.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads, variant.qkv_bias
        )
        self.o_proj = RowParallelLinear(
            self.num_heads * self.head_dim, hf.hidden_size, variant.o_proj_bias
        )
        # This rank's heads (all of them without tensor parallelism).
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_norm = RMSNorm(self.head_dim, hf.rms_norm_eps) if variant.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, hf.rms_norm_eps) if variant.qk_norm else None
        self.rotary_emb = rotary_emb  # shared by all layers: one cos/sin table per model
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            num_kv_heads=self.num_kv_heads,
            prefix=_join(prefix, "attn"),
            config=config,
            sliding_window=layer_sliding_window(config, layer_idx),
            attn_type=variant.attn_type,
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        q, k, v = self.qkv_proj(hidden_states).split(self.qkv_proj.output_sizes, dim=-1)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q.reshape(num_tokens, self.num_heads, self.head_dim))
            k = self.k_norm(k.reshape(num_tokens, self.num_kv_heads, self.head_dim))
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q.flatten(1), k.flatten(1), v)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    """SwiGLU with gate and up fused into one matmul.

    Under TP each rank holds `intermediate_size / tp` of the gate/up rows and down columns; the
    down projection all-reduces unless `reduce_results=False` (then the output is this rank's
    partial sum, for a caller that reduces it together with something else).
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        bias: bool,
        *,
        reduce_results: bool = True,
        size_name: str = "intermediate_size",
    ):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias, what=size_name
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias, what=size_name, reduce_results=reduce_results
        )
        self.act_fn = get_act_and_mul(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: EngineConfig,
        variant: DecoderVariant,
        rotary_emb: RotaryEmbedding,
        layer_idx: int,
        prefix: str,
        make_mlp: MlpFactory | None = None,
    ) -> None:
        super().__init__()
        hf = config.model.hf_config
        self.self_attn = LlamaAttention(
            config, variant, rotary_emb, layer_idx, _join(prefix, "self_attn")
        )
        mlp = make_mlp(config, layer_idx, _join(prefix, "mlp")) if make_mlp else None
        if mlp is None:
            mlp = LlamaMLP(hf.hidden_size, hf.intermediate_size, hf.hidden_act, variant.mlp_bias)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hf.hidden_size, hf.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hf.hidden_size, hf.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the layer's output *before* its residual add, plus the running residual.

        Deferring each add into the next norm is what lets `RMSNorm` fuse it.
        """
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class ResidualStack(PipelineStack):
    """The forward pass of a stack of Llama-style layers, which return their output before the
    residual add (`LlamaDecoderLayer.forward`): Llama's, DeepSeek's, gpt-oss's. The subclass
    builds `embed_tokens`, the stage's layers (`build_stage`) and a fusing `norm`; between
    stages the hidden states travel with the running residual."""

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """`inputs_embeds` (a multimodal model's text embeddings with its image embeddings
        merged in) replaces the lookup of `input_ids`; `intermediate_tensors` (the previous
        pipeline stage's output) replaces both on a later stage."""
        if intermediate_tensors is not None:
            hidden_states, residual = (
                intermediate_tensors.hidden_states,
                intermediate_tensors.residual,
            )
        else:
            if inputs_embeds is None:
                hidden_states = self.embed_tokens(input_ids)
            else:
                hidden_states = inputs_embeds
            residual = None
        for i in range(self.start_layer, self.end_layer):
            hidden_states, residual = self.layers[i](positions, hidden_states, residual)
        if not self.is_last_stage:
            assert residual is not None
            return IntermediateTensors(hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaModel(ResidualStack):
    """The decoder stack; under pipeline parallelism only this stage's part of it.

    A stage holds the decoder layers `[start_layer, end_layer)` (`pp_state.pp_layer_range`),
    the embedding if it is the first stage and the final norm if it is the last; the rest are
    `StageAbsent` placeholders, so names and indices stay the checkpoint's. A stage other than
    the first starts from the previous stage's `IntermediateTensors`; one other than the last
    returns its own instead of normalized hidden states.
    """

    def __init__(
        self,
        config: EngineConfig,
        variant: DecoderVariant,
        prefix: str = "model",
        make_mlp: MlpFactory | None = None,
    ) -> None:
        super().__init__()
        mc = config.model
        hf = mc.hf_config
        rope_theta, rope_scaling = get_rope_config(hf)
        # Positions never reach max_model_len, so the table need not cover the full
        # max_position_embeddings (128k rows for Llama 3.1).
        self.rotary_emb = RotaryEmbedding(mc.head_dim, mc.max_model_len, rope_theta, rope_scaling)
        stage = self.build_stage(
            hf.num_hidden_layers,
            lambda i: LlamaDecoderLayer(
                config, variant, self.rotary_emb, i, _join(prefix, f"layers.{i}"), make_mlp
            ),
        )
        self.embed_tokens = only_on(
            stage.is_first, lambda: VocabParallelEmbedding(hf.vocab_size, hf.hidden_size)
        )
        self.norm = only_on(stage.is_last, lambda: RMSNorm(hf.hidden_size, hf.rms_norm_eps))


class LlamaForCausalLM(PipelineForCausalLM):
    # Runs as pipeline stages (`LlamaModel` builds one stage's layers); a subclass that adds
    # inputs later stages would need (3-D positions, pooled outputs) says False.
    supports_pp: ClassVar[bool] = True
    # HF keeps q/k/v and gate/up apart; here they are row shards of one fused weight.
    stacked_params_mapping: tuple[tuple[str, str, str | int], ...] = (
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    )

    def __init__(self, config: EngineConfig, prefix: str = "") -> None:
        super().__init__()
        hf = config.model.hf_config
        variant = self.decoder_variant(hf)
        self.model = LlamaModel(config, variant, _join(prefix, "model"), self.make_mlp)
        self.tie_word_embeddings = bool(getattr(hf, "tie_word_embeddings", False))
        self.lm_head, self._head_from_embedding = stage_lm_head(
            self.model, hf, self.tie_word_embeddings
        )

    @classmethod
    def decoder_variant(cls, hf_config: Any) -> DecoderVariant:
        bias = bool(getattr(hf_config, "attention_bias", False))
        mlp_bias = bool(getattr(hf_config, "mlp_bias", False))
        return DecoderVariant(qkv_bias=bias, o_proj_bias=bias, mlp_bias=mlp_bias)

    def make_mlp(self, config: EngineConfig, layer_idx: int, prefix: str) -> nn.Module | None:
        """The feed-forward block of layer `layer_idx`; None means the dense LlamaMLP."""
        return None

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """float32 logits for the rows the runner chose to sample (not every token)."""
        return self.lm_head(hidden_states)

    def _ignored(self, name: str) -> bool:
        if name.endswith(("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")):
            return True
        if self.tie_word_embeddings and name == "lm_head.weight":
            return True
        return not self._on_this_stage(name)

    def _on_this_stage(self, name: str) -> bool:
        """Whether the tensor belongs to a module this pipeline stage holds (or, for a tied
        head without the embedding, is the embedding's tensor the head loads)."""
        if self._head_from_embedding and "embed_tokens." in name:
            return True
        return held_by_stage(self, name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors in (this pipeline stage's only); returns the names of the
        parameters fully filled."""
        kept = ((name, tensor) for name, tensor in weights if not self._ignored(name))
        if self._head_from_embedding:
            kept = (
                ("lm_head.weight" if "embed_tokens." in name else name, tensor)
                for name, tensor in kept
            )
        return load_stacked_weights(self, kept, self.stacked_params_mapping)
