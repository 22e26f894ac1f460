"""DeepSeek-V2 and DeepSeek-V3: multi-head latent attention plus DeepSeek's MoE, token-wise.

Attention (MLA): queries come from `q_proj`, or through a low-rank bottleneck (`q_a_proj`,
`q_a_layernorm`, `q_b_proj`) when `q_lora_rank` is set. Keys and values come from one small
latent per token: `kv_a_proj_with_mqa` gives `[c_kv (kv_lora_rank) | k_pe (qk_rope_head_dim)]`,
`c_kv` is normalised (`kv_a_layernorm`), and only `k_pe` and the query's last
`qk_rope_head_dim` dims are rotated, over interleaved pairs (V3 with `rope_interleave=False`:
halves). `MLAAttention` caches that latent and expands it with `kv_b_proj` (whose weight it
gets on each call). RoPE may be scaled with YaRN, as DeepSeek ships it. Softmax scale:
`(qk_nope + qk_rope)^-0.5`, times `mscale^2` when a scaled RoPE sets `mscale_all_dim` (as
transformers does).

Feed-forward: the first `first_k_dense_replace` layers are dense SwiGLU MLPs, the rest
`DeepseekMoE` (transformers ignores `moe_layer_freq`, and so does this file when it is 1;
other values are refused).

Tensor parallelism (as vLLM keeps MLA): the heads are split over the ranks. `q_proj` /
`q_b_proj` and `kv_b_proj` are column-parallel (their rows are per head, so a contiguous slice
of rows is a contiguous run of heads) and `o_proj` row-parallel. The latent path is replicated:
`q_a_proj`, `kv_a_proj_with_mqa` and their norms are the same on every rank, so every rank
caches the *whole* latent of its tokens (it is one vector per token, shared by all heads:
there is nothing per head to split) and absorbs / expands it with its own heads' slice of
`kv_b_proj`. The MoE layers shard as `DeepseekMoE` says.

Pipeline parallelism: the stack is Llama's (`ResidualStack`): a stage builds and loads only its
layers (each with its own latent cache) and hands the next the hidden states and the residual.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from tokenwise.attention.backends.mla_backend import MLAHeadDims
from tokenwise.attention.mla import MLAAttention
from tokenwise.attention.utils import get_mla_dims
from tokenwise.config import EngineConfig
from tokenwise.layers import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    get_rope_config,
)
from tokenwise.layers.fused_moe import load_weights_with_experts, make_expert_params_mapping
from tokenwise.layers.linear import divide
from tokenwise.layers.pipeline import (
    PipelineForCausalLM,
    only_on,
    stage_lm_head,
    stage_weights,
)
from tokenwise.layers.rope_yarn import yarn_get_mscale
from tokenwise.models.deepseek_moe import DeepseekMoE
from tokenwise.models.llama import LlamaMLP, ResidualStack


def mla_softmax_scale(qk_head_dim: int, rope_scaling: dict[str, Any] | None) -> float:
    """transformers' scale: `qk_head_dim^-0.5`, times `mscale^2` for a scaled RoPE with
    `mscale_all_dim` (`mscale = 0.1 * mscale_all_dim * ln(factor) + 1` for `factor > 1`)."""
    scale = qk_head_dim**-0.5
    if not rope_scaling or not rope_scaling.get("mscale_all_dim"):
        return scale
    mscale = yarn_get_mscale(float(rope_scaling["factor"]), float(rope_scaling["mscale_all_dim"]))
    return scale * mscale * mscale


class DeepseekV2Attention(nn.Module):
    """MLA's projections around `MLAAttention`, holding this TP rank's heads.

    `rope_in_fp32`: rotate in float32 and round back, as transformers' DeepSeek-V2 does (V3
    rotates in the activation dtype); it changes only bf16/fp16 results.

    Under TP the per-head projections are sliced by heads and the latent projections are
    replicated (see the module docstring); `self.dims.num_heads` is the local head count, so
    the attention layer (and its latent cache, whose width does not depend on heads) is this
    rank's. `num_attention_heads` must divide by the TP size: a head is never split.
    """

    def __init__(
        self,
        config: EngineConfig,
        rotary_emb: RotaryEmbedding,
        scale: float,
        prefix: str,
        rope_in_fp32: bool = False,
    ) -> None:
        super().__init__()
        self.rope_in_fp32 = rope_in_fp32
        hf = config.model.hf_config
        d = get_mla_dims(hf)
        total_heads = int(hf.num_attention_heads)
        # Checked on the head count (not on the row counts below, which may divide although
        # the heads do not), so the error names what the user has to change.
        self.dims = MLAHeadDims(
            divide(total_heads, "num_attention_heads"),
            d.qk_nope_head_dim,
            d.qk_rope_head_dim,
            d.v_head_dim,
            d.kv_lora_rank,
        )
        qk_head_dim = d.qk_nope_head_dim + d.qk_rope_head_dim
        bias = bool(getattr(hf, "attention_bias", False))
        self.q_lora_rank = d.q_lora_rank
        if d.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hf.hidden_size, total_heads * qk_head_dim)
        else:
            self.q_a_proj = ReplicatedLinear(hf.hidden_size, d.q_lora_rank, bias)
            self.q_a_layernorm = RMSNorm(d.q_lora_rank, hf.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(d.q_lora_rank, total_heads * qk_head_dim)
        self.kv_a_proj_with_mqa = ReplicatedLinear(
            hf.hidden_size, d.kv_lora_rank + d.qk_rope_head_dim, bias
        )
        self.kv_a_layernorm = RMSNorm(d.kv_lora_rank, hf.rms_norm_eps)
        self.kv_b_proj = ColumnParallelLinear(
            d.kv_lora_rank, total_heads * (d.qk_nope_head_dim + d.v_head_dim)
        )
        # The attention reads this weight itself (absorbed into q and the output): stays dense.
        self.kv_b_proj.quant_exempt = True
        self.o_proj = RowParallelLinear(total_heads * d.v_head_dim, hf.hidden_size, bias)
        self.rotary_emb = rotary_emb  # shared by all layers
        self.attn = MLAAttention(self.dims, scale, prefix=f"{prefix}.attn", config=config)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        dims, num_tokens = self.dims, hidden_states.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(num_tokens, dims.num_heads, -1)
        q_nope, q_pe = q.split([dims.qk_nope_head_dim, dims.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_proj_with_mqa(hidden_states)
        kv_c, k_pe = latent.split([dims.kv_lora_rank, dims.qk_rope_head_dim], dim=-1)
        kv_c = self.kv_a_layernorm(kv_c)
        k_pe = k_pe.unsqueeze(1)
        if self.rope_in_fp32:
            q32, k32 = self.rotary_emb(positions, q_pe.float(), k_pe.float())
            q_pe, k_pe = q32.to(q_pe.dtype), k32.to(k_pe.dtype)
        else:
            q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe)
        q = torch.cat((q_nope, q_pe), dim=-1).flatten(1)
        out = self.attn(q, kv_c, k_pe.flatten(1), self.kv_b_proj.weight)
        return self.o_proj(out)


class DeepseekV2DecoderLayer(nn.Module):
    def __init__(
        self,
        config: EngineConfig,
        rotary_emb: RotaryEmbedding,
        scale: float,
        layer_idx: int,
        prefix: str,
        is_v3: bool,
    ) -> None:
        super().__init__()
        hf = config.model.hf_config
        self.self_attn = DeepseekV2Attention(
            config, rotary_emb, scale, f"{prefix}.self_attn", rope_in_fp32=not is_v3
        )
        if layer_idx >= int(getattr(hf, "first_k_dense_replace", 0) or 0):
            self.mlp: nn.Module = DeepseekMoE(config, f"{prefix}.mlp", is_v3)
        else:
            bias = bool(getattr(hf, "mlp_bias", False))
            self.mlp = LlamaMLP(hf.hidden_size, hf.intermediate_size, hf.hidden_act, bias)
        self.input_layernorm = RMSNorm(hf.hidden_size, hf.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hf.hidden_size, hf.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's output before its residual add, and the running residual (as Llama)."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class DeepseekV2Model(ResidualStack):
    def __init__(self, config: EngineConfig, prefix: str, is_v3: bool) -> None:
        super().__init__()
        mc = config.model
        hf = mc.hf_config
        d = get_mla_dims(hf)
        rope_theta, rope_scaling = get_rope_config(hf)
        interleaved = bool(getattr(hf, "rope_interleave", True)) if is_v3 else True
        self.rotary_emb = RotaryEmbedding(
            d.qk_rope_head_dim,
            mc.max_model_len,
            rope_theta,
            rope_scaling,
            is_neox_style=not interleaved,
        )
        scale = mla_softmax_scale(d.qk_nope_head_dim + d.qk_rope_head_dim, rope_scaling)
        stage = self.build_stage(
            hf.num_hidden_layers,
            lambda i: DeepseekV2DecoderLayer(
                config, self.rotary_emb, scale, i, f"{prefix}.layers.{i}", is_v3
            ),
        )
        self.embed_tokens = only_on(
            stage.is_first, lambda: VocabParallelEmbedding(hf.vocab_size, hf.hidden_size)
        )
        self.norm = only_on(stage.is_last, lambda: RMSNorm(hf.hidden_size, hf.rms_norm_eps))


class DeepseekV2ForCausalLM(PipelineForCausalLM):
    # The engine reads this to know that the model has expert layers (DP shards them).
    is_moe: ClassVar[bool] = True
    supports_pp: ClassVar[bool] = True  # `DeepseekV2Model` builds one stage's layers
    is_v3: ClassVar[bool] = False
    # Only the dense MLPs' gate/up are fused; q, the latents and kv_b_proj stay separate.
    stacked_params_mapping: tuple[tuple[str, str, str | int], ...] = (
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    )

    def __init__(self, config: EngineConfig, prefix: str = "") -> None:
        super().__init__()
        hf = config.model.hf_config
        freq = int(getattr(hf, "moe_layer_freq", 1) or 1)
        if freq != 1:
            raise ValueError(f"moe_layer_freq must be 1 (as transformers assumes), got {freq}")
        self.model = DeepseekV2Model(config, f"{prefix}.model" if prefix else "model", self.is_v3)
        self.tie_word_embeddings = bool(getattr(hf, "tie_word_embeddings", False))
        self.lm_head, self._head_from_embedding = stage_lm_head(
            self.model, hf, self.tie_word_embeddings
        )
        self.num_experts = int(hf.n_routed_experts)
        self.num_layers = int(hf.num_hidden_layers)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """float32 logits for the rows the runner chose to sample."""
        return self.lm_head(hidden_states)

    def _ignored(self, name: str) -> bool:
        if name.endswith("rotary_emb.inv_freq"):
            return True
        parts = name.split(".")
        if (
            parts[:2] == ["model", "layers"]
            and parts[2].isdigit()
            and int(parts[2]) >= self.num_layers
        ):
            return True  # V3's MTP module (`tokenwise.models.deepseek_mtp`), not the target's
        return self.tie_word_embeddings and name == "lm_head.weight"

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors in (this pipeline stage's; experts per expert or stacked);
        strict like the others."""
        kept = ((name, tensor) for name, tensor in weights if not self._ignored(name))
        kept = stage_weights(self, kept, self._head_from_embedding)
        experts = make_expert_params_mapping(self.num_experts, "gate_proj", "up_proj", "down_proj")
        return load_weights_with_experts(self, kept, self.stacked_params_mapping, experts)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """The same network; routing is V3's (sigmoid, choice bias, always grouped)."""

    is_v3: ClassVar[bool] = True
