"""DeepSeek-V3's multi-token prediction (MTP) module as a draft head.

DeepSeek-V3 checkpoints keep one MTP module after the decoder stack, as the extra layer
`model.layers.{num_hidden_layers}` (`num_nextn_predict_layers` of them; the first is used):
`enorm` and `hnorm` (RMSNorms of the next token's embedding and of the target's last hidden
state), `eh_proj` (`[h, 2h]` over their concatenation), a full decoder layer (MLA attention and
the MoE feed-forward, named as any layer's), `shared_head.norm` and `shared_head.head` (its LM
head), and usually its own `embed_tokens`. transformers loads none of it; vLLM runs it as an
EAGLE-style proposer, which is how it runs here (`tokenwise.spec_decode.eagle`): at position
`p` it reads the token at `p + 1` and the target's hidden state at `p` (after the final norm)
and predicts the token at `p + 2`; its output (layer output plus residual) is fed back for the
next draft. As in vLLM, the embedding at position 0 is zeroed (nothing precedes it).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tokenwise.attention.utils import get_mla_dims
from tokenwise.config import EngineConfig
from tokenwise.layers import RMSNorm, RotaryEmbedding, VocabParallelEmbedding, get_rope_config
from tokenwise.layers.fused_moe import load_weights_with_experts, make_expert_params_mapping
from tokenwise.models.deepseek_v2 import (
    DeepseekV2DecoderLayer,
    DeepseekV2ForCausalLM,
    mla_softmax_scale,
)

# The module's own tensors (under `model.layers.{L}.`); the rest belong to its decoder layer.
_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")


class SharedHead(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps)
        self.head = nn.Linear(hidden_size, vocab_size, bias=False)


class DeepSeekMTPHead(nn.Module):
    stacked_params_mapping = DeepseekV2ForCausalLM.stacked_params_mapping

    def __init__(
        self, config: EngineConfig, target: nn.Module, is_v3: bool, own_embedding: bool
    ) -> None:
        super().__init__()
        mc = config.model
        hf = mc.hf_config
        h = int(hf.hidden_size)
        self.layer_index = int(hf.num_hidden_layers)
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
        self.enorm = RMSNorm(h, hf.rms_norm_eps)
        self.hnorm = RMSNorm(h, hf.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.mtp_block = DeepseekV2DecoderLayer(
            config, self.rotary_emb, scale, self.layer_index, "mtp_block", is_v3
        )
        self.shared_head = SharedHead(h, int(hf.vocab_size), hf.rms_norm_eps)
        self.embed_tokens = VocabParallelEmbedding(int(hf.vocab_size), h) if own_embedding else None
        self.num_experts = int(hf.n_routed_experts)
        self._target = (target,)

    def combine(self, target_hidden: torch.Tensor) -> torch.Tensor:
        return target_hidden

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        embed = self.embed_tokens
        if embed is None:
            embed = self._target[0].model.embed_tokens
        embeds = embed(input_ids).masked_fill((positions == 0).unsqueeze(-1), 0.0)
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        x, residual = self.mtp_block(positions, x, None)
        out = x + residual
        return out, out

    def greedy(self, rows: torch.Tensor, vocab_size: int) -> torch.Tensor:
        logits = self.shared_head.head(self.shared_head.norm(rows))
        return logits[:, :vocab_size].float().argmax(dim=-1)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The target checkpoint's `model.layers.{num_hidden_layers}.*` tensors; the rest of
        the checkpoint (the target itself, further MTP layers) is skipped."""
        prefix = f"model.layers.{self.layer_index}."
        kept = []
        for name, tensor in weights:
            if not name.startswith(prefix):
                continue
            rest = name[len(prefix) :]
            kept.append((rest if rest.startswith(_OWN) else f"mtp_block.{rest}", tensor))
        experts = make_expert_params_mapping(self.num_experts, "gate_proj", "up_proj", "down_proj")
        return load_weights_with_experts(self, kept, self.stacked_params_mapping, experts)


__all__ = ["DeepSeekMTPHead"]
