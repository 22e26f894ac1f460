"""Qwen3-Next: a hybrid of Gated DeltaNet layers and gated full attention, with MoE.

`config.layer_types` says which layers mix tokens with linear attention (`linear_attn`, a
`GatedDeltaNet` whose state lives in the engine's recurrent slots) and which with full
attention (`self_attn`, K/V in the paged cache); by default three of every four are linear.
The full-attention layers differ from Qwen3's in three ways: `q_proj` also produces an output
gate per head (rows `[q, gate]` per head; the attention output is scaled by `sigmoid(gate)`),
RoPE turns only the first `partial_rotary_factor` of each head, and every RMSNorm of the
decoder (layer norms, q/k norms, the final norm) is zero-centred: its scale is `1 + weight`
(`GemmaRMSNorm`). Feed-forward blocks are Qwen2-MoE's (routed experts plus a sigmoid-gated
shared expert) on the layers `decoder_sparse_step` / `mlp_only_layers` make sparse.

Qwen3.5 (`qwen3_5.py`) is the same decoder with the linear-attention projections split by
part and, for the dense models, plain MLPs; it subclasses this file's model.

The MTP head the checkpoints ship (`mtp.*`, skipped here) is the speculative method "mtp"
(`qwen3_next_mtp.py`). The decoder stack builds only a pipeline stage's layers (each layer adds
its own output, so a stage hands on its hidden states alone); the engine still refuses
pipeline parallelism for these models (`distributed/pp_launch.py` says why).

At decode size the gated attention's glue (q/k norms, partial RoPE, the output gate) and the
residual adds are C calls (`native/gated_attn.c`), and the Gated DeltaNet step one more
(`native/gdn_decode.c`): with the linear and attention kernels that is the whole forward, so
the dense models' decode steps replay CPU graphs (`runner/recurrent_graph.py`). MoE blocks
still run torch ops, so those models decode eagerly; CUDA graphs are not built for hybrids.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

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
from tokenwise.layers.linear import divide
from tokenwise.layers.pipeline import PipelineStack, only_on, stage_lm_head
from tokenwise.models.gated_deltanet import GatedDeltaNet
from tokenwise.models.llama import LlamaForCausalLM, LlamaMLP, MlpFactory
from tokenwise.models.qwen2_moe import Qwen2MoeSparseMoeBlock
from tokenwise.models.sparse_moe import MoeForCausalLM, is_sparse_layer
from tokenwise.native import gated_attn

LINEAR, FULL = "linear_attention", "full_attention"


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def partial_rope(hf: Any, head_dim: int, max_len: int) -> RotaryEmbedding:
    """RoPE over the first `partial_rotary_factor * head_dim` channels of each head.

    Qwen3.5's multimodal RoPE (`mrope_section`) rotates by one position per channel section;
    for text every section has the same position, which is plain RoPE."""
    theta, scaling = get_rope_config(hf)
    params = getattr(hf, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0))
    if scaling is not None:
        for key in ("partial_rotary_factor", "mrope_section", "mrope_interleaved"):
            scaling.pop(key, None)
    return RotaryEmbedding(int(head_dim * float(factor)), max_len, theta, scaling)


class GatedAttention(nn.Module):
    """Full attention with a per-head output gate from `q_proj` and partial RoPE.

    `q_proj` is loaded as the q part of a `QKVParallelLinear` with twice the heads (each head's
    q and gate rows are adjacent), so a TP rank holds its heads' q and gate together."""

    def __init__(self, config: EngineConfig, rotary_emb: RotaryEmbedding, prefix: str) -> None:
        super().__init__()
        hf = config.model.hf_config
        heads, kv_heads = int(hf.num_attention_heads), config.model.num_kv_heads
        self.head_dim = config.model.head_dim
        divide(heads, "num_attention_heads")
        bias = bool(getattr(hf, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(hf.hidden_size, self.head_dim, 2 * heads, kv_heads, bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads // 2, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(heads * self.head_dim, hf.hidden_size, bias)
        self.q_norm = GemmaRMSNorm(self.head_dim, hf.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, hf.rms_norm_eps)
        self.rotary_emb = rotary_emb
        self.rotary_dim = rotary_emb.head_dim
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            num_kv_heads=self.num_kv_heads,
            prefix=_join(prefix, "attn"),
            config=config,
        )

    def _rope(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple:
        rot = self.rotary_dim
        q_rot, k_rot = self.rotary_emb(
            positions, q[..., :rot].contiguous(), k[..., :rot].contiguous()
        )
        q = torch.cat([q_rot.view(q.shape[0], q.shape[1], rot), q[..., rot:]], dim=-1)
        k = torch.cat([k_rot.view(k.shape[0], k.shape[1], rot), k[..., rot:]], dim=-1)
        return q, k

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        n, d = hidden_states.shape[0], self.head_dim
        qkv = self.qkv_proj(hidden_states)
        q_gate, k, v = qkv.split(self.qkv_proj.output_sizes, dim=-1)
        if self.rotary_emb.is_neox_style and self.k_norm.eps == self.q_norm.eps:
            heads = (self.num_heads, self.num_kv_heads, d, self.rotary_dim)
            fused = gated_attn.gated_qk(
                qkv, positions, self.rotary_emb.cos_sin_cache, self.q_norm.weight,
                self.k_norm.weight, self.q_norm.eps, heads,
            )  # fmt: skip
            if fused is not None:  # decode rows: the glue in C (`gated_attn.c`)
                out = self.attn(*fused, v)
                gated = gated_attn.sigmoid_gate(out, qkv, self.num_heads, d)
                if gated is None:
                    gate = q_gate.view(n, self.num_heads, 2, d)[:, :, 1].reshape(n, -1)
                    gated = out * torch.sigmoid(gate)
                return self.o_proj(gated)
        q, gate = q_gate.view(n, self.num_heads, 2, d).unbind(dim=2)
        q = self.q_norm(q)
        k = self.k_norm(k.view(n, self.num_kv_heads, d))
        q, k = self._rope(positions, q, k)
        out = self.attn(q.reshape(n, -1), k.reshape(n, -1), v)
        return self.o_proj(out * torch.sigmoid(gate.reshape(n, -1)))


class HybridDecoderLayer(nn.Module):
    def __init__(
        self,
        config: EngineConfig,
        rotary_emb: RotaryEmbedding,
        layer_idx: int,
        prefix: str,
        make_mlp: MlpFactory,
        layer_type: str | None = None,
    ) -> None:
        """`layer_type` (default: the config's `layer_types[layer_idx]`) is given for the MTP
        head's layer, a full-attention layer after the decoder's."""
        super().__init__()
        hf = config.model.hf_config
        self.layer_type = layer_type or hf.layer_types[layer_idx]
        if self.layer_type == LINEAR:
            self.linear_attn = GatedDeltaNet(config, _join(prefix, "linear_attn"))
        elif self.layer_type == FULL:
            self.self_attn = GatedAttention(config, rotary_emb, _join(prefix, "self_attn"))
        else:
            raise ValueError(
                f"layer_types[{layer_idx}] is {self.layer_type!r}; Gated DeltaNet hybrids "
                f"have {LINEAR!r} and {FULL!r} layers"
            )
        mlp = make_mlp(config, layer_idx, _join(prefix, "mlp"))
        if mlp is None:
            mlp = LlamaMLP(hf.hidden_size, hf.intermediate_size, hf.hidden_act, False)
        self.mlp = mlp
        self.input_layernorm = GemmaRMSNorm(hf.hidden_size, hf.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(hf.hidden_size, hf.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        x = self.input_layernorm(hidden_states)
        if self.layer_type == LINEAR:
            x = self.linear_attn(x)
        else:
            x = self.self_attn(positions, x)
        hidden_states = _add(hidden_states, x)
        return _add(hidden_states, self.mlp(self.post_attention_layernorm(hidden_states)))


def _add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a + b`: a C call for decode rows (recordable into a CPU graph), torch's add otherwise."""
    out = gated_attn.add(a, b)
    return a + b if out is None else out


class HybridModel(PipelineStack):
    """The decoder stack, or a pipeline stage's part of it."""

    def __init__(self, config: EngineConfig, prefix: str, make_mlp: MlpFactory) -> None:
        super().__init__()
        mc = config.model
        hf = mc.hf_config
        self.rotary_emb = partial_rope(hf, mc.head_dim, mc.max_model_len)
        stage = self.build_stage(
            int(hf.num_hidden_layers),
            lambda i: HybridDecoderLayer(
                config, self.rotary_emb, i, _join(prefix, f"layers.{i}"), make_mlp
            ),
        )
        self.embed_tokens = only_on(
            stage.is_first, lambda: VocabParallelEmbedding(hf.vocab_size, hf.hidden_size)
        )
        self.norm = only_on(stage.is_last, lambda: GemmaRMSNorm(hf.hidden_size, hf.rms_norm_eps))


class Qwen3NextForCausalLM(MoeForCausalLM):
    is_moe: ClassVar[bool] = True
    # The stack builds per stage (`HybridModel`); every stage must hold both layer kinds.
    supports_pp: ClassVar[bool] = True
    stacked_params_mapping = (
        *LlamaForCausalLM.stacked_params_mapping,
        ("in_proj", "in_proj_qkvz", "qkvz"),
        ("in_proj", "in_proj_ba", "ba"),
    )
    # Checkpoint name prefixes of a vision-language checkpoint's text decoder -> this model's.
    text_prefixes: ClassVar[tuple[tuple[str, str], ...]] = ()

    def __init__(self, config: EngineConfig, prefix: str = "") -> None:
        nn.Module.__init__(self)
        hf = config.model.hf_config
        self.model = HybridModel(config, _join(prefix, "model"), self.make_mlp)
        self.tie_word_embeddings = bool(getattr(hf, "tie_word_embeddings", False))
        self.lm_head, self._head_from_embedding = stage_lm_head(
            self.model, hf, self.tie_word_embeddings
        )

    @classmethod
    def check_pipeline_split(cls, hf_config: Any, parts: list[int]) -> None:
        """Refuse a split (`parts`: layers per stage) that leaves a stage without one of the
        two kinds of layer: the engine lays out one set of KV-cache groups (full attention,
        then recurrent state) whose tables every stage reads by index, so every stage must
        hold both (called by `pp_launch` before any stage starts)."""
        start = 0
        for stage, count in enumerate(parts):
            kinds = set(hf_config.layer_types[start : start + count])
            start += count
            if kinds != {LINEAR, FULL}:
                raise ValueError(
                    f"pipeline_parallel_size={len(parts)} splits the layers {parts}, which "
                    f"gives stage {stage} only {' and '.join(sorted(kinds))} layers: every "
                    f"stage of a Gated DeltaNet hybrid must hold both {LINEAR} and {FULL} "
                    "layers (one set of KV-cache groups serves all stages); set "
                    "TOKENWISE_PP_LAYER_PARTITION accordingly"
                )

    def make_mlp(self, config: EngineConfig, layer_idx: int, prefix: str) -> nn.Module | None:
        if not is_sparse_layer(config.model.hf_config, layer_idx):
            return None
        return Qwen2MoeSparseMoeBlock(config, prefix)

    def _ignored(self, name: str) -> bool:
        # The MTP head (not built) and, in a vision-language checkpoint, the vision tower.
        if name.startswith(("mtp.", "model.visual.")):
            return True
        return super()._ignored(name)

    def _text_name(self, name: str) -> str:
        for old, new in self.text_prefixes:
            if name.startswith(old):
                return new + name[len(old) :]
        return name

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        return super().load_weights((self._text_name(n), t) for n, t in weights)
