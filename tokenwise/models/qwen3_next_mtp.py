"""The multi-token-prediction (MTP) head of Qwen3-Next and Qwen3.5 checkpoints, as a draft head.

The checkpoints keep it under `mtp.`: `pre_fc_norm_embedding` and `pre_fc_norm_hidden`
(zero-centred RMSNorms of the next token's embedding and of the target's last hidden state),
`fc` (`[h, 2h]` over their concatenation, embedding first), one full-attention decoder layer
(`layers.0`, gated attention and the model's feed-forward block, named as any layer's) and
`norm`; the embedding and the LM head are the target's. transformers skips it; vLLM runs it as
an EAGLE-style proposer (speculative method "mtp"), and so does `tokenwise.spec_decode`: at
position `p` it reads the token at `p + 1` and the target's (final-normed) hidden state at `p`,
predicts the token at `p + 2` through the target's LM head, and feeds its own normed output
back for the next draft. Its attention layer has its own KV cache in the draft runner.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from tokenwise.config import EngineConfig
from tokenwise.layers import ReplicatedLinear
from tokenwise.layers.fused_moe import load_weights_with_experts, make_expert_params_mapping
from tokenwise.layers.layernorm import GemmaRMSNorm
from tokenwise.models.qwen3_next import FULL, HybridDecoderLayer, partial_rope

PREFIX = "mtp."


def has_mtp_head(names: set[str]) -> bool:
    """Whether a checkpoint's tensor names include an MTP head."""
    return f"{PREFIX}fc.weight" in names


class Qwen3NextMTPHead(nn.Module):
    # The routed experts' projections as checkpoints name them (the GGUF loader and quantizer
    # ask for them expert by expert, as they do of the target).
    expert_proj_names: ClassVar[tuple[str, str, str]] = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, config: EngineConfig, target: Any) -> None:
        super().__init__()
        mc = config.model
        hf = mc.hf_config
        h, eps = int(hf.hidden_size), float(hf.rms_norm_eps)
        index = int(hf.num_hidden_layers)  # where the head's layer sits after the decoder's
        self.stacked_params_mapping = type(target).stacked_params_mapping
        self.rotary_emb = partial_rope(hf, mc.head_dim, mc.max_model_len)
        self.pre_fc_norm_embedding = GemmaRMSNorm(h, eps)
        self.pre_fc_norm_hidden = GemmaRMSNorm(h, eps)
        self.fc = ReplicatedLinear(2 * h, h, bias=False)
        self.layers = nn.ModuleList(
            [HybridDecoderLayer(config, self.rotary_emb, index, "layers.0", target.make_mlp, FULL)]
        )
        self.norm = GemmaRMSNorm(h, eps)
        self.num_experts = int(getattr(hf, "num_experts", 0) or 0) if target.is_moe else 0
        self._target = (target,)  # not a submodule: its weights are the target's

    def combine(self, target_hidden: torch.Tensor) -> torch.Tensor:
        return target_hidden

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(rows for the LM head, rows fed back)`: both the head's normed output."""
        embeds = self._target[0].model.embed_tokens(input_ids)
        x = torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], -1)
        out = self.norm(self.layers[0](positions, self.fc(x)))
        return out, out

    def greedy(self, rows: torch.Tensor, vocab_size: int) -> torch.Tensor:
        logits = self._target[0].compute_logits(rows)
        return logits[:, :vocab_size].float().argmax(dim=-1)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's `mtp.*` tensors; the rest (the target itself) is skipped."""
        kept = [(n[len(PREFIX) :], t) for n, t in weights if n.startswith(PREFIX)]
        experts = make_expert_params_mapping(self.num_experts, *self.expert_proj_names)
        return load_weights_with_experts(self, kept, self.stacked_params_mapping, experts)


__all__ = ["Qwen3NextMTPHead", "has_mtp_head"]
