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

The 26B-A4B model's routed experts (`enable_moe_block`) are in `gemma4_moe.py`. Not built:
bidirectional attention over text (`use_bidirectional_attention="all"`), refused by name. Images, video and audio
of `Gemma4ForConditionalGeneration` are not served: its towers' weights are skipped and the
model is text-only.
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
from tokenwise.models.gemma2 import SLIDING, Gemma2ForCausalLM, gemma_layer_types
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


def layer_attention_shape(hf: Any, layer: int, layer_type: str) -> tuple[int, int]:
    """`(head_dim, num_key_value_heads)` of one layer: global layers differ from sliding ones.

    transformers 5.x resolves them per layer (`per_layer_config`); a plain config (GGUF, older
    files) says `global_head_dim` / `num_global_key_value_heads` for the global layers.
    """
    per_layer = getattr(hf, "per_layer_config", None)
    if per_layer is not None:
        lc = per_layer[layer]
        return int(lc.head_dim), int(lc.num_key_value_heads)
    head_dim, kv_heads = int(hf.head_dim), int(hf.num_key_value_heads)
    if layer_type != SLIDING:
        head_dim = int(getattr(hf, "global_head_dim", None) or head_dim)
        if getattr(hf, "attention_k_eq_v", False):
            kv_heads = int(getattr(hf, "num_global_key_value_heads", None) or kv_heads)
    return head_dim, kv_heads


def kv_producers(hf: Any, layer_types: list[str]) -> list[int | None]:
    """For each layer, the earlier layer whose KV cache it reads (None: its own).

    The last `num_kv_shared_layers` layers share; each reads the last non-sharing layer of
    its own type (transformers' `kv_sharing_modes`)."""
    n, shared = len(layer_types), int(getattr(hf, "num_kv_shared_layers", 0) or 0)
    first = n - shared
    out: list[int | None] = [None] * n
    for i in range(first, n):
        owners = [j for j in range(first) if layer_types[j] == layer_types[i]]
        if not owners:
            raise ValueError(
                f"Gemma 4 layer {i} ({layer_types[i]}) shares KV (num_kv_shared_layers="
                f"{shared}) but no earlier layer of that type computes any"
            )
        out[i] = owners[-1]
    return out


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


class Gemma4Model(nn.Module):
    def __init__(self, config: EngineConfig, prefix: str) -> None:
        super().__init__()
        mc = config.model
        hf = mc.hf_config
        check_gemma4_config(hf)
        size, layers = int(hf.hidden_size), int(hf.num_hidden_layers)
        self.embed_tokens = VocabParallelEmbedding(int(hf.vocab_size), size)
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
        built: list[Gemma4DecoderLayer] = []
        for i, layer_type in enumerate(layer_types):
            owner = producers[i]
            producer = None if owner is None else built[owner].self_attn
            plan = LayerPlan(i, layer_type, ropes[layer_type], producer)
            built.append(Gemma4DecoderLayer(config, plan, f"{prefix}.layers.{i}"))
        self.layers = nn.ModuleList(built)
        self.kv_shared = [p is not None for p in producers]
        self.norm = Gemma4RMSNorm(size, float(hf.rms_norm_eps))
        self.ple_size = int(getattr(hf, "hidden_size_per_layer_input", 0) or 0)
        if self.ple_size:
            ple_vocab = int(getattr(hf, "vocab_size_per_layer_input", hf.vocab_size))
            self.embed_tokens_per_layer = VocabParallelEmbedding(ple_vocab, layers * self.ple_size)
            self.per_layer_model_projection = ReplicatedLinear(size, layers * self.ple_size)
            self.per_layer_projection_norm = Gemma4RMSNorm(self.ple_size, float(hf.rms_norm_eps))

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
    ) -> torch.Tensor:
        hidden_states = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        ple = self.per_layer_inputs(input_ids, hidden_states) if self.ple_size else None
        shared_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for i, layer in enumerate(self.layers):
            per_layer = ple[:, i] if ple is not None else None
            hidden_states = layer(positions, hidden_states, per_layer, shared_kv)
        return self.norm(hidden_states)


class Gemma4ForCausalLM(Gemma2ForCausalLM):
    """Gemma 2's LM head (tied embeddings, final soft-cap) over the Gemma 4 decoder."""

    model: Gemma4Model

    def build_model(self, config: EngineConfig, prefix: str) -> nn.Module:
        return Gemma4Model(config, prefix)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF-named tensors in. q/k/v and gate/up go to their fused parameters, except the
        query of a KV-sharing layer (its own `q_proj`); with `attention_k_eq_v` a global
        layer's `k_proj` fills the v rows too (HF uses the key projection as the value)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()

        def routed() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if self.tie_word_embeddings and name == "lm_head.weight":
                    continue
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


class Gemma4ForConditionalGeneration(Gemma4ForCausalLM):
    """The hub's Gemma 4 checkpoints (with vision and audio towers), served as text only: the
    language model's tensors (`model.language_model.*`) load, the towers' and their
    embedders' are skipped, and requests with images or audio are refused as for any
    text-only model."""

    _SKIPPED = (
        "model.vision_tower.",
        "model.audio_tower.",
        "model.embed_vision.",
        "model.embed_audio.",
    )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def text_only() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith(self._SKIPPED):
                    continue
                yield name.replace("model.language_model.", "model.", 1), tensor

        return super().load_weights(text_only())
