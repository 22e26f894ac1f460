"""Qwen2-MoE: Qwen2 attention (q/k/v biases) with routed experts plus a gated shared expert.

The shared expert is a dense SwiGLU MLP every token goes through; its output is scaled by
`sigmoid(shared_expert_gate(x))`, one scalar per token, and added to the routed experts'. It is
replicated on every DP rank (only routed experts are sharded); under TP it is sharded like a
dense MLP, and its partial output is all-reduced together with the routed experts'. `norm_topk_prob`,
`decoder_sparse_step` and `mlp_only_layers` behave as in Qwen3-MoE.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from tokenwise.config import EngineConfig
from tokenwise.distributed.tp_state import get_tp_size, tp_all_reduce
from tokenwise.layers import ReplicatedLinear
from tokenwise.models.llama import DecoderVariant, LlamaMLP
from tokenwise.models.sparse_moe import (
    MoeForCausalLM,
    SparseMoeBlock,
    is_sparse_layer,
    qwen_moe_routing,
)


class Qwen2MoeSparseMoeBlock(SparseMoeBlock):
    def __init__(self, config: EngineConfig, prefix: str) -> None:
        hf = config.model.hf_config
        super().__init__(
            config,
            prefix=prefix,
            **qwen_moe_routing(hf),
        )
        # Under TP the shared expert is sharded like a dense MLP; its partial output is reduced
        # together with the routed experts' (the gate scales each token, so it commutes).
        self.tp_size = get_tp_size()
        self.shared_expert = LlamaMLP(
            hf.hidden_size,
            int(hf.shared_expert_intermediate_size),
            hf.hidden_act,
            bias=False,
            reduce_results=self.tp_size == 1,
            size_name="shared_expert_intermediate_size",
        )
        self.shared_expert_gate = ReplicatedLinear(hf.hidden_size, 1, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shared = self.shared_expert(hidden_states)
        gate = torch.sigmoid(self.shared_expert_gate(hidden_states))
        if self.tp_size > 1:
            routed = self.experts.forward_partial(hidden_states, self.gate(hidden_states))
            return tp_all_reduce(routed + gate * shared)
        routed = super().forward(hidden_states)
        return routed + gate * shared


class Qwen2MoeForCausalLM(MoeForCausalLM):
    is_moe: ClassVar[bool] = True

    @classmethod
    def decoder_variant(cls, hf_config: Any) -> DecoderVariant:
        return DecoderVariant(qkv_bias=bool(getattr(hf_config, "qkv_bias", True)))

    def make_mlp(self, config: EngineConfig, layer_idx: int, prefix: str) -> nn.Module | None:
        if not is_sparse_layer(config.model.hf_config, layer_idx):
            return None
        return Qwen2MoeSparseMoeBlock(config, prefix)
