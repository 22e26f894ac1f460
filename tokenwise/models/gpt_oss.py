"""gpt-oss (OpenAI's open-weight MoE), written token-wise.

What sets it apart from the Llama-family MoEs, and where each piece lives:
- attention sinks: one learned logit per head joins every softmax denominator (no value), so a
  head can attend to nothing much; `Attention(sinks=...)` carries it into every backend path
  (SDPA-free prefill, the C decode kernel, the Triton kernel). A sink holds no cache memory.
- layers alternate a sliding window (128 tokens in the released models) and full attention,
  from `config.layer_types`; each layer's `Attention` gets its own window, so the KV-cache
  spec and the block manager treat the two kinds as Gemma 2's (windowed blocks are freed).
- YaRN RoPE (`layers/rope_yarn.py`, with `truncate` as transformers reads it), q/k/v and o
  projections with biases;
- MoE in every layer: a router with a bias, softmax over the top-k logits, experts with
  biases and the clamped SwiGLU (`fused_moe/biased.py`), dense or MXFP4 as published
  (`layers/quantization/mxfp4.py`: kept 4-bit, run by a CPU kernel).

Pipeline parallelism: the stack is Llama's (`ResidualStack`); a stage builds and loads only its
layers' experts and hands the next the hidden states and the residual.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from tokenwise.attention.layer import Attention
from tokenwise.config import EngineConfig
from tokenwise.distributed.tp_state import get_tp_rank
from tokenwise.layers import (
    QKVParallelLinear,
    ReplicatedLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    get_rope_config,
)
from tokenwise.layers.fused_moe.biased import BiasedFusedMoE
from tokenwise.layers.pipeline import (
    PipelineForCausalLM,
    only_on,
    stage_lm_head,
    stage_weights,
)
from tokenwise.layers.quantization.mxfp4 import mxfp4_method_for
from tokenwise.layers.weight_utils import CheckpointTensor, copy_checked, load_stacked_weights
from tokenwise.models.llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    ResidualStack,
    layer_sliding_window,
)

_EXPERTS = ".mlp.experts."


class GptOssAttention(nn.Module):
    def __init__(
        self, config: EngineConfig, rotary_emb: RotaryEmbedding, layer_idx: int, prefix: str
    ) -> None:
        super().__init__()
        hf = config.model.hf_config
        head_dim = config.model.head_dim
        bias = bool(getattr(hf, "attention_bias", True))
        self.qkv_proj = QKVParallelLinear(
            hf.hidden_size, head_dim, int(hf.num_attention_heads), config.model.num_kv_heads, bias
        )
        self.o_proj = RowParallelLinear(
            int(hf.num_attention_heads) * head_dim, hf.hidden_size, bias
        )
        num_heads, num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        # This rank's heads' sink logits (the checkpoint's `self_attn.sinks`, sliced).
        self.sinks = nn.Parameter(torch.empty(num_heads), requires_grad=False)
        self.sinks.weight_loader = self._load_sinks
        self.rotary_emb = rotary_emb
        self.attn = Attention(
            num_heads,
            head_dim,
            head_dim**-0.5,
            num_kv_heads=num_kv_heads,
            prefix=f"{prefix}.attn",
            config=config,
            sliding_window=layer_sliding_window(config, layer_idx),
            sinks=self.sinks,
        )

    def _load_sinks(
        self, param: nn.Parameter, loaded: CheckpointTensor, shard: object = None
    ) -> None:
        total, local = self.qkv_proj.total_num_heads, param.shape[0]
        if tuple(loaded.shape) != (total,):
            raise ValueError(
                f"sinks: expected ({total},), the checkpoint has {tuple(loaded.shape)}"
            )
        start = get_tp_rank() * local
        copy_checked(param, loaded[start : start + local])

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states).split(self.qkv_proj.output_sizes, dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class GptOssMoE(nn.Module):
    """The router (a linear layer with a bias) and the routed experts; no shared expert."""

    def __init__(self, config: EngineConfig, prefix: str) -> None:
        super().__init__()
        hf = config.model.hf_config
        num_experts = int(hf.num_local_experts)
        self.router = ReplicatedLinear(hf.hidden_size, num_experts, bias=True)
        self.experts = BiasedFusedMoE(
            num_experts,
            int(hf.num_experts_per_tok),
            hf.hidden_size,
            int(hf.intermediate_size),
            config,
            activation="swigluoai",
            swiglu_alpha=float(getattr(hf, "swiglu_alpha", 1.702)),
            swiglu_limit=float(getattr(hf, "swiglu_limit", 7.0)),
            quant_method=mxfp4_method_for(config),
            prefix=f"{prefix}.experts",
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden_states, self.router(hidden_states))


class GptOssDecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm layer (its `forward`, residual adds fused into the norms) around
    gpt-oss's attention and MoE."""

    def __init__(
        self, config: EngineConfig, rotary_emb: RotaryEmbedding, layer_idx: int, prefix: str
    ) -> None:
        nn.Module.__init__(self)
        hf = config.model.hf_config
        self.self_attn = GptOssAttention(config, rotary_emb, layer_idx, f"{prefix}.self_attn")
        self.mlp = GptOssMoE(config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(hf.hidden_size, hf.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hf.hidden_size, hf.rms_norm_eps)


class GptOssModel(ResidualStack):
    def __init__(self, config: EngineConfig, prefix: str = "model") -> None:
        super().__init__()
        mc = config.model
        hf = mc.hf_config
        theta, scaling = get_rope_config(hf)
        self.rotary_emb = RotaryEmbedding(mc.head_dim, mc.max_model_len, theta, scaling)
        stage = self.build_stage(
            hf.num_hidden_layers,
            lambda i: GptOssDecoderLayer(config, self.rotary_emb, i, f"{prefix}.layers.{i}"),
        )
        self.embed_tokens = only_on(
            stage.is_first, lambda: VocabParallelEmbedding(hf.vocab_size, hf.hidden_size)
        )
        self.norm = only_on(stage.is_last, lambda: RMSNorm(hf.hidden_size, hf.rms_norm_eps))


class GptOssForCausalLM(PipelineForCausalLM):
    is_moe: ClassVar[bool] = True
    supports_pp: ClassVar[bool] = True  # `GptOssModel` builds one stage's layers
    stacked_params_mapping = LlamaForCausalLM.stacked_params_mapping[:3]  # q/k/v only

    def __init__(self, config: EngineConfig, prefix: str = "") -> None:
        super().__init__()
        hf = config.model.hf_config
        self.model = GptOssModel(config, f"{prefix}.model" if prefix else "model")
        self.tie_word_embeddings = bool(getattr(hf, "tie_word_embeddings", False))
        self.lm_head, self._head_from_embedding = stage_lm_head(
            self.model, hf, self.tie_word_embeddings
        )

    def num_experts(self) -> int:
        return int(self.model.layers[self.model.start_layer].mlp.experts.num_experts)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF-named tensors in: expert tensors (stacked over experts, dense or MXFP4) go to
        their layer's `load_stacked`, the rest through the q/k/v mapping."""
        experts = {n: m for n, m in self.named_modules() if isinstance(m, BiasedFusedMoE)}
        filled: set[str] = set()

        def dense() -> Iterable[tuple[str, torch.Tensor]]:
            tied = self.tie_word_embeddings
            kept = ((n, t) for n, t in weights if not (tied and n == "lm_head.weight"))
            for name, tensor in stage_weights(self, kept, self._head_from_embedding):
                if _EXPERTS in name:
                    owner, _, rel = name.rpartition(".")
                    if owner in experts:
                        try:
                            param = experts[owner].load_stacked(rel, tensor)
                        except ValueError as e:
                            raise ValueError(f"cannot load checkpoint tensor {name!r}: {e}") from e
                        filled.add(f"{owner}.{param}")
                        continue
                yield name, tensor

        loaded = load_stacked_weights(self, dense(), self.stacked_params_mapping)
        for layer in experts.values():
            if layer.quant_method is not None:
                layer.quant_method.process_weights_after_loading(layer)
        return loaded | filled
