"""Qwen3-MoE: Qwen3 attention (per-head q/k norms) with routed experts and no shared expert.

`norm_topk_prob` decides whether the top-k weights are renormalised; they are rounded to the
activation dtype before scaling expert outputs, as HF does. `decoder_sparse_step` and
`mlp_only_layers` leave some layers with a dense MLP of `intermediate_size`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar

from torch import nn

from tokenwise.config import EngineConfig
from tokenwise.models.llama import DecoderVariant
from tokenwise.models.sparse_moe import (
    MoeForCausalLM,
    SparseMoeBlock,
    is_sparse_layer,
    qwen_moe_routing,
)


class Qwen3MoeForCausalLM(MoeForCausalLM):
    is_moe: ClassVar[bool] = True

    @classmethod
    def decoder_variant(cls, hf_config: Any) -> DecoderVariant:
        return replace(super().decoder_variant(hf_config), qk_norm=True)

    def make_mlp(self, config: EngineConfig, layer_idx: int, prefix: str) -> nn.Module | None:
        hf = config.model.hf_config
        if not is_sparse_layer(hf, layer_idx):
            return None
        return SparseMoeBlock(
            config,
            prefix=prefix,
            **qwen_moe_routing(hf),
        )
