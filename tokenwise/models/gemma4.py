"""Gemma 4's text model (`Gemma4ForCausalLM`; the text part of `Gemma4ForConditionalGeneration`).

Gemma 4 keeps Gemma 3's frame (sliding and global layers from `layer_types`, four norms per
layer, embeddings scaled by `sqrt(hidden_size)`, a final logit soft-cap) and changes:
- Norms are plain `weight * x` RMSNorms (`Gemma4RMSNorm`), and values get a scale-free RMSNorm
  beside the q/k head norms; the attention scale is 1 (the norms set the magnitude).
- Global layers have their own head size (`global_head_dim`, through transformers'
  `per_layer_config`) and "proportional" RoPE: a quarter of the frequency pairs rotate and the
  rest pass through. The two kinds of layers therefore have different KV pages, and each
  sliding layer declares its window so that its KV-cache group frees what left it.
- `attention_k_eq_v` (the larger models): global layers have no `v_proj`; the value is the key
  projection before its norm and RoPE. The checkpoint's `k_proj` is loaded into both the k and
  the v rows of the fused projection, which gives exactly that.
- Per-layer embeddings (PLE, the E2B/E4B models): a second embedding table gives every layer a
  small vector per token, mixed with a projection of the main embedding; each layer gates it
  into its residual stream after the MLP.
- KV sharing (`num_kv_shared_layers`): the last layers compute no K/V of their own and attend
  over the cache of the last earlier layer of their type. Such a layer calls that layer's
  `Attention` with its own queries and the stored keys and values: the cache write repeats the
  same values into the same slots, and the metadata (block tables of the producer's KV-cache
  group) is the producer's, so nothing in the engine knows about the sharing. Shared layers may
  have a double-width MLP (`use_double_wide_mlp`).
- A learned `layer_scalar` multiplies each layer's output.
- Pipeline parallelism: the first stage computes every layer's per-layer inputs (they need the
  token embedding) and sends the later layers' ones on with the hidden states
  (`IntermediateTensors.per_layer_inputs`). A KV-sharing layer reads its producer's cache and
  this step's keys, so a split that puts the two on different stages is refused, as is one
  that gives the stages different kinds of KV cache (`gemma4_layout.check_stage_split`,
  before any stage starts).

The 26B-A4B model's routed experts (`enable_moe_block`) are in `gemma4_moe.py`. Not built:
bidirectional attention over text (`use_bidirectional_attention="all"`), refused by name. The
hub's `Gemma4ForConditionalGeneration` (with images) is in `gemma4_vl.py`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tokenwise.attention.layer import Attention
from tokenwise.config import EngineConfig
from tokenwise.layers import (
    ColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    get_act_fn,
    get_rope_config,
    load_stacked_weights,
)
from tokenwise.layers.layernorm import Gemma4RMSNorm
from tokenwise.layers.pipeline import IntermediateTensors, PipelineStack, only_on
from tokenwise.models.gemma2 import SLIDING, Gemma2ForCausalLM, gemma_layer_types
from tokenwise.models.gemma4_layout import check_stage_split, kv_producers, layer_attention_shape
from tokenwise.models.gemma4_moe import EXPERT_TENSORS, Gemma4Experts, Gemma4Router
from tokenwise.models.llama import LlamaMLP


def check_gemma4_config(hf: Any) -> None:
    """Refuse, by name, a Gemma 4 option that is not built (before any weight is allocated).

    `use_bidirectional_attention="vision"` (the larger hub models) makes only image tokens
    attend both ways: text is causal, so a text-only model runs it as is; `"all"` (every
    token both ways, an encoder) is not built."""
    mode = getattr(hf, "use_bidirectional_attention", None)
    if mode not in (None, "vision"):
        raise NotImplementedError(
            f"Gemma 4 with use_bidirectional_attention={mode!r} (bidirectional attention over "
            "text) is not supported"
        )


@dataclass(frozen=True)
class LayerPlan:
    """What one decoder layer is: its index and attention type, the RoPE table of that type,
    and the earlier attention whose KV cache it reads (None: it computes its own)."""

    index: int
    layer_type: str
    rotary_emb: RotaryEmbedding
    producer: Gemma4Attention | None


class Gemma4Attention(nn.Module):
    def __init__(self, config: EngineConfig, plan: LayerPlan, prefix: str) -> None:
        super().__init__()
        hf = config.model.hf_config
        layer_type, producer = plan.layer_type, plan.producer
        self.head_dim, kv_heads = layer_attention_shape(hf, plan.index, layer_type)
        heads, hidden = int(hf.num_attention_heads), int(hf.hidden_size)
        bias, eps = bool(getattr(hf, "attention_bias", False)), float(hf.rms_norm_eps)
        self.rotary_emb = plan.rotary_emb
        self.q_norm = Gemma4RMSNorm(self.head_dim, eps)
        self.o_proj = RowParallelLinear(heads * self.head_dim, hidden, bias)
        # Not a submodule: the producer is registered (and loaded) at its own layer.
        self._producer = [producer] if producer is not None else []
        if producer is not None:
            self.q_proj = ColumnParallelLinear(hidden, heads * self.head_dim, bias)
            self.num_heads = producer.num_heads
            return
        self.k_eq_v = bool(getattr(hf, "attention_k_eq_v", False)) and layer_type != SLIDING
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, heads, kv_heads, bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.k_norm = Gemma4RMSNorm(self.head_dim, eps)
        self.v_norm = Gemma4RMSNorm(self.head_dim, eps, with_scale=False)
        window = int(hf.sliding_window) if layer_type == SLIDING else None
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            1.0,
            num_kv_heads=self.num_kv_heads,
            prefix=f"{prefix}.attn",
            config=config,
            sliding_window=window,
        )

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        shared_kv: dict[int, tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Attend; a producing layer leaves its keys/values in `shared_kv` (keyed by the
        producing module's id) for the layers that share them."""
        t, d = hidden_states.shape[0], self.head_dim
        if self._producer:
            producer = self._producer[0]
            q = self.q_norm(self.q_proj(hidden_states).view(t, self.num_heads, d))
            q, _ = self.rotary_emb(positions, q, q[:, :1])  # a one-head stand-in for k
            k, v = shared_kv[id(producer)]
            return self.o_proj(producer.attn(q.flatten(1), k, v))
        q, k, v = self.qkv_proj(hidden_states).split(self.qkv_proj.output_sizes, dim=-1)
        q = self.q_norm(q.reshape(t, self.num_heads, d))
        k = self.k_norm(k.reshape(t, self.num_kv_heads, d))
        v = self.v_norm(v.reshape(t, self.num_kv_heads, d)).flatten(1)
        q, k = self.rotary_emb(positions, q, k)
        k = k.flatten(1)
        shared_kv[id(self)] = (k, v)
        return self.o_proj(self.attn(q.flatten(1), k, v))


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, config: EngineConfig, plan: LayerPlan, prefix: str) -> None:
        super().__init__()
        hf = config.model.hf_config
        size, eps = int(hf.hidden_size), float(hf.rms_norm_eps)
        self.self_attn = Gemma4Attention(config, plan, f"{prefix}.self_attn")
        wide = plan.producer is not None and bool(getattr(hf, "use_double_wide_mlp", False))
        inter = int(hf.intermediate_size) * (2 if wide else 1)
        self.mlp = LlamaMLP(size, inter, hf.hidden_activation, bias=False)
        self.input_layernorm = Gemma4RMSNorm(size, eps)
        self.post_attention_layernorm = Gemma4RMSNorm(size, eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(size, eps)
        self.post_feedforward_layernorm = Gemma4RMSNorm(size, eps)
        # A checkpoint value (1 in a fresh model), hence a parameter so the loader fills it.
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)
        self.router: Gemma4Router | None = None
        if getattr(hf, "enable_moe_block", False):  # routed experts beside the MLP
            self.router = Gemma4Router(size, int(hf.num_experts), eps)
            self.experts = Gemma4Experts(config, self.router, f"{prefix}.experts")
            self.post_feedforward_layernorm_1 = Gemma4RMSNorm(size, eps)
            self.pre_feedforward_layernorm_2 = Gemma4RMSNorm(size, eps)
            self.post_feedforward_layernorm_2 = Gemma4RMSNorm(size, eps)
        self.ple_size = int(getattr(hf, "hidden_size_per_layer_input", 0) or 0)
        if self.ple_size:
            self.act_fn = get_act_fn(hf.hidden_activation)
            self.per_layer_input_gate = ReplicatedLinear(size, self.ple_size)
            self.per_layer_projection = ReplicatedLinear(self.ple_size, size)
            self.post_per_layer_input_norm = Gemma4RMSNorm(size, eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        per_layer_input: torch.Tensor | None,
        shared_kv: dict[int, tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        attn = self.self_attn(positions, self.input_layernorm(hidden_states), shared_kv)
        hidden_states = hidden_states + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden_states))
        if self.router is not None:
            logits = self.router(hidden_states)
            moe = self.experts(self.pre_feedforward_layernorm_2(hidden_states), logits)
            mlp = self.post_feedforward_layernorm_1(mlp) + self.post_feedforward_layernorm_2(moe)
        hidden_states = hidden_states + self.post_feedforward_layernorm(mlp)
        if per_layer_input is not None:
            gate = self.act_fn(self.per_layer_input_gate(hidden_states)) * per_layer_input
            ple = self.post_per_layer_input_norm(self.per_layer_projection(gate))
            hidden_states = hidden_states + ple
        return hidden_states * self.layer_scalar


def _scaled(t: torch.Tensor, scale: float) -> torch.Tensor:
    """`t * scale` with the scale rounded to t's dtype first, as transformers' scaled embedding."""
    return t * torch.tensor(scale, dtype=t.dtype)


class Gemma4Model(PipelineStack):
    def __init__(self, config: EngineConfig, prefix: str) -> None:
        super().__init__()
        mc = config.model
        hf = mc.hf_config
        check_gemma4_config(hf)
        size, layers = int(hf.hidden_size), int(hf.num_hidden_layers)
        self.embed_scale = float(size) ** 0.5
        layer_types = gemma_layer_types(hf)
        ropes: dict[str, RotaryEmbedding] = {}
        for i, layer_type in enumerate(layer_types):
            if layer_type not in ropes:
                theta, scaling = get_rope_config(hf, layer_type)
                head_dim = layer_attention_shape(hf, i, layer_type)[0]
                ropes[layer_type] = RotaryEmbedding(head_dim, mc.max_model_len, theta, scaling)
        self.rotary_embs = nn.ModuleList(ropes.values())
        producers = kv_producers(hf, layer_types)
        built: dict[int, Gemma4DecoderLayer] = {}

        def build(i: int) -> Gemma4DecoderLayer:
            owner = producers[i]  # on this stage: `check_stage_split` refused the rest
            producer = None if owner is None else built[owner].self_attn
            plan = LayerPlan(i, layer_types[i], ropes[layer_types[i]], producer)
            built[i] = Gemma4DecoderLayer(config, plan, f"{prefix}.layers.{i}")
            return built[i]

        stage = self.build_stage(layers, build)
        self.kv_shared = [p is not None for p in producers]
        eps = float(hf.rms_norm_eps)
        first = stage.is_first
        self.embed_tokens = only_on(first, lambda: VocabParallelEmbedding(int(hf.vocab_size), size))
        self.norm = only_on(stage.is_last, lambda: Gemma4RMSNorm(size, eps))
        self.ple_size = int(getattr(hf, "hidden_size_per_layer_input", 0) or 0)
        if self.ple_size:  # the per-layer inputs are computed on the first stage only
            ple_vocab = int(getattr(hf, "vocab_size_per_layer_input", hf.vocab_size))
            width = layers * self.ple_size
            self.embed_tokens_per_layer = only_on(
                first, lambda: VocabParallelEmbedding(ple_vocab, width)
            )
            self.per_layer_model_projection = only_on(first, lambda: ReplicatedLinear(size, width))
            self.per_layer_projection_norm = only_on(
                first, lambda: Gemma4RMSNorm(self.ple_size, eps)
            )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return _scaled(self.embed_tokens(input_ids), self.embed_scale)

    def per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """`[tokens, layers, ple_size]`: the token's own per-layer rows plus a normed projection
        of its main embedding, averaged in norm (times 2 ** -0.5), as transformers."""
        n, size = len(self.layers), self.ple_size
        own = _scaled(self.embed_tokens_per_layer(input_ids), float(size) ** 0.5)
        proj = self.per_layer_model_projection(embeds) * float(embeds.shape[-1]) ** -0.5
        proj = self.per_layer_projection_norm(proj.unflatten(-1, (n, size)))
        return (proj + own.unflatten(-1, (n, size))) * 2.0**-0.5

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """On a later pipeline stage `intermediate_tensors` carries the hidden states and the
        per-layer inputs of this stage's layers onwards (`ple[:, 0]` is `start_layer`'s)."""
        if intermediate_tensors is not None:
            hidden_states = intermediate_tensors.hidden_states
            ple = intermediate_tensors.per_layer_inputs
        else:
            hidden_states = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
            ple = self.per_layer_inputs(input_ids, hidden_states) if self.ple_size else None
        shared_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for i in range(self.start_layer, self.end_layer):
            per_layer = ple[:, i - self.start_layer] if ple is not None else None
            hidden_states = self.layers[i](positions, hidden_states, per_layer, shared_kv)
        if not self.is_last_stage:
            rest = ple[:, self.end_layer - self.start_layer :] if ple is not None else None
            return IntermediateTensors(hidden_states, per_layer_inputs=rest)
        return self.norm(hidden_states)


class Gemma4ForCausalLM(Gemma2ForCausalLM):
    """Gemma 2's LM head (tied embeddings, final soft-cap) over the Gemma 4 decoder."""

    model: Gemma4Model

    def build_model(self, config: EngineConfig, prefix: str) -> nn.Module:
        return Gemma4Model(config, prefix)

    @classmethod
    def check_pipeline_split(cls, hf_config: Any, parts: list[int]) -> None:
        """Called by the engine before starting the stages (`pp_launch`)."""
        check_gemma4_config(hf_config)
        check_stage_split(hf_config, parts)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF-named tensors in. q/k/v and gate/up go to their fused parameters, except the
        query of a KV-sharing layer (its own `q_proj`); with `attention_k_eq_v` a global
        layer's `k_proj` fills the v rows too (HF uses the key projection as the value)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()

        def routed() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in self.stage_weights(weights):
                layer = _layer_index(name)
                expert = name.rpartition(".experts.")[2] if ".experts." in name else None
                if layer is not None and expert in EXPERT_TENSORS:  # stacked: all experts
                    target, shard = EXPERT_TENSORS[expert]
                    experts = self.model.layers[layer].experts
                    experts.weight_loader(getattr(experts, target), tensor, shard, None)
                    loaded.add(f"{name.rpartition('.experts.')[0]}.experts.{target}")
                    continue
                if layer is not None and self.model.kv_shared[layer] and ".q_proj." in name:
                    param = params[name]
                    param.weight_loader(param, tensor)  # type: ignore[attr-defined]
                    loaded.add(name)
                    continue
                yield name, tensor
                if layer is not None and ".k_proj." in name:
                    attn = self.model.layers[layer].self_attn
                    if getattr(attn, "k_eq_v", False):
                        yield name.replace(".k_proj.", ".v_proj."), tensor

        return load_stacked_weights(self, routed(), self.stacked_params_mapping) | loaded


def _layer_index(name: str) -> int | None:
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "layers" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None
