"""EAGLE-1 draft head for Llama-family targets, in the published checkpoint layout.

An EAGLE head extrapolates the target's features: at position `p` it sees the embedding of the
token at `p + 1` and the target's last hidden state at `p` (after the final norm), fuses them
with `fc` (`[h, 2h]` over their concatenation) and runs one Llama decoder layer over the result,
with K/V of its own. Its output (the layer's output plus its residual, with no final norm)
goes through the *target's* LM head and predicts the token at `p + 2`; fed back with the
token just proposed, it gives the next draft.

Checkpoint layout (SafeAILab's EAGLE, as vLLM's `llama_eagle.py` reads it): `fc.weight` (and
`fc.bias` in the original training code's checkpoints), `layers.0.*` as in a Llama layer. Layer
0 has no input norm in EAGLE (its `input_layernorm.weight`, when a checkpoint still has one, is
not used), and the head shares the target's embedding and LM head (a checkpoint's own copies of
them are ignored). Names may carry a `model.` prefix.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tokenwise.config import EngineConfig
from tokenwise.layers import RotaryEmbedding, get_rope_config, load_stacked_weights
from tokenwise.models.llama import LlamaDecoderLayer, LlamaForCausalLM

# Checkpoint tensors the head does not use (see the module docstring).
_EAGLE1_UNUSED = ("embed_tokens.weight", "lm_head.weight", "layers.0.input_layernorm.weight")


def strip_model_prefix(name: str) -> str:
    return name[len("model.") :] if name.startswith("model.") else name


def eagle_rotary(config: EngineConfig) -> RotaryEmbedding:
    mc = config.model
    rope_theta, rope_scaling = get_rope_config(mc.hf_config)
    return RotaryEmbedding(mc.head_dim, mc.max_model_len, rope_theta, rope_scaling)


class EagleLlamaHead(nn.Module):
    """EAGLE-1: `fc` over (token embedding, target hidden state), one decoder layer."""

    stacked_params_mapping = LlamaForCausalLM.stacked_params_mapping

    def __init__(self, config: EngineConfig, target: nn.Module, fc_bias: bool) -> None:
        super().__init__()
        hf = config.model.hf_config
        h = int(hf.hidden_size)
        self.rotary_emb = eagle_rotary(config)
        variant = LlamaForCausalLM.decoder_variant(hf)
        self.fc = nn.Linear(2 * h, h, bias=fc_bias)
        layer = LlamaDecoderLayer(config, variant, self.rotary_emb, 0, "layers.0")
        layer.input_layernorm = nn.Identity()  # EAGLE's layer 0 has no input norm
        self.layers = nn.ModuleList([layer])
        # The target's embedding and LM head; a tuple so they are not parameters of the head.
        self._target = (target,)

    def combine(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """The target's rows as the head takes them: its last hidden states, unchanged."""
        return target_hidden

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(rows for the LM head, rows to feed back)`: the same tensor for EAGLE-1."""
        target = self._target[0]
        embeds = target.model.embed_tokens(input_ids)
        x = self.fc(torch.cat([embeds, hidden.to(embeds.dtype)], dim=-1))
        x, residual = self.layers[0](positions, x, None)
        out = x + residual
        return out, out

    def greedy(self, rows: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """The target-vocabulary argmax of the target's LM head over `rows`."""
        return self._target[0].compute_logits(rows)[:, :vocab_size].argmax(dim=-1)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        kept = (
            (strip_model_prefix(name), tensor)
            for name, tensor in weights
            if strip_model_prefix(name) not in _EAGLE1_UNUSED
        )
        return load_stacked_weights(self, kept, self.stacked_params_mapping)


__all__ = ["EagleLlamaHead", "eagle_rotary", "strip_model_prefix"]
