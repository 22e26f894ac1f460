"""EAGLE-3 draft head for Llama-family targets, in the published checkpoint layout.

EAGLE-3 reads three of the target's layers instead of its last one: the residual stream at the
input of each of `aux_layers` (vLLM's default: layers 2, L // 2 and L - 3 of L), concatenated
(`3h`) and fused by `fc` (`[h, 3h]`) into one feature per position. Its one decoder layer (the
"midlayer") attends over the concatenation of the normed token embedding (`input_layernorm`)
and the normed feature (`hidden_norm`), so q/k/v take `2h` inputs; the feature itself is the
residual. Its own `norm` and `lm_head` score a *draft vocabulary* (`draft_vocab_size` tokens,
often much smaller than the target's), and `d2t` maps a draft id `d` to the target id
`d + d2t[d]`. The pre-norm output is what is fed back, with the token just proposed, for the
next draft; the fused feature is used only for positions the target computed.

Checkpoint layout (as vLLM's `llama_eagle3.py` reads it): `fc.weight`, `midlayer.*` (or
`layers.0.*`), `norm.weight`, `lm_head.weight`, `d2t` (int64; required when the draft
vocabulary is smaller than the target's), `t2d` (unused), and `embed_tokens.weight` only when
the head does not share the target's embedding. Names may carry a `model.` prefix.
`eagle_config.eagle_aux_hidden_state_layer_ids` in its config.json overrides the layers read.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from tokenwise.config import EngineConfig
from tokenwise.layers import (
    QKVParallelLinear,
    RMSNorm,
    VocabParallelEmbedding,
    load_stacked_weights,
)
from tokenwise.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from tokenwise.models.llama_eagle import eagle_rotary, strip_model_prefix


def eagle3_aux_layers(head_hf_config: Any, target_num_layers: int) -> tuple[int, ...]:
    """The target layers whose inputs EAGLE-3 reads (vLLM's choice unless the config names
    them); each must be a layer of the target."""
    eagle_config = getattr(head_hf_config, "eagle_config", None) or {}
    ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids = (2, target_num_layers // 2, target_num_layers - 3)
    layers = tuple(int(i) for i in ids)
    if (
        len(layers) != 3
        or len(set(layers)) != 3
        or not all(0 <= i < target_num_layers for i in layers)
    ):
        raise ValueError(
            f"speculative_config.model: EAGLE-3 reads the inputs of 3 distinct target layers in "
            f"[0, {target_num_layers}); got {list(layers)} (set "
            "eagle_config.eagle_aux_hidden_state_layer_ids in the head's config.json for a "
            "target this shallow)"
        )
    return tuple(sorted(layers))


class Eagle3Midlayer(LlamaDecoderLayer):
    """A Llama layer whose attention reads (normed embedding, normed feature): `2h` wide."""

    def __init__(self, config: EngineConfig, rotary: Any) -> None:
        hf = config.model.hf_config
        variant = LlamaForCausalLM.decoder_variant(hf)
        super().__init__(config, variant, rotary, 0, "midlayer")
        attn = self.self_attn
        self.self_attn.qkv_proj = QKVParallelLinear(
            2 * int(hf.hidden_size),
            attn.head_dim,
            attn.num_heads,
            attn.num_kv_heads,
            variant.qkv_bias,
        )
        self.hidden_norm = RMSNorm(int(hf.hidden_size), hf.rms_norm_eps)
        self.norm_before_residual = bool(getattr(hf, "norm_before_residual", False))

    def forward(  # type: ignore[override]
        self, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Eagle3LlamaHead(nn.Module):
    stacked_params_mapping = LlamaForCausalLM.stacked_params_mapping

    def __init__(
        self, config: EngineConfig, target: nn.Module, target_hidden: int, own_embedding: bool
    ) -> None:
        super().__init__()
        hf = config.model.hf_config
        h = int(hf.hidden_size)
        self.draft_vocab_size = int(getattr(hf, "draft_vocab_size", None) or hf.vocab_size)
        self.rotary_emb = eagle_rotary(config)
        self.fc = nn.Linear(3 * target_hidden, h, bias=False)
        self.midlayer = Eagle3Midlayer(config, self.rotary_emb)
        self.norm = RMSNorm(h, hf.rms_norm_eps)
        self.lm_head = nn.Linear(h, self.draft_vocab_size, bias=False)
        self.embed_tokens = VocabParallelEmbedding(int(hf.vocab_size), h) if own_embedding else None
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.int64))
        self._target = (target,)

    def combine(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """The target's three layers' rows (`[n, 3h]`) fused into one feature per position."""
        return self.fc(target_hidden.to(self.fc.weight.dtype))

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(normed rows for the LM head, pre-norm rows to feed back)`."""
        embed = self.embed_tokens
        if embed is None:
            embed = self._target[0].model.embed_tokens
        x, residual = self.midlayer(positions, embed(input_ids), hidden)
        return self.norm(x, residual)

    def greedy(self, rows: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """The argmax over the draft vocabulary, as a target token id."""
        draft = self.lm_head(rows).float().argmax(dim=-1)
        return draft + self.d2t[draft]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = set()
        rest = []
        for name, tensor in weights:
            name = strip_model_prefix(name).replace("layers.0.", "midlayer.", 1)
            if name == "t2d":
                continue
            if name == "d2t":
                if tuple(tensor.shape) != (self.draft_vocab_size,):
                    raise ValueError(
                        f"checkpoint tensor 'd2t' has shape {tuple(tensor.shape)}, expected "
                        f"({self.draft_vocab_size},) (draft_vocab_size)"
                    )
                self.d2t.copy_(tensor.to(torch.int64))
                loaded.add(name)
                continue
            rest.append((name, tensor))
        return loaded | load_stacked_weights(self, rest, self.stacked_params_mapping)


__all__ = ["Eagle3LlamaHead", "Eagle3Midlayer", "eagle3_aux_layers"]
