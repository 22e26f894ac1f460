"""Mixture-of-experts: top-k routing, stacked experts, DP sharding and expert weight loading.

This package sits above the forward context (see `tokenwise.tools.check_layers`): `FusedMoE`
reads the step's DP metadata to exchange tokens between ranks. The rest of `tokenwise.layers`
stays free of engine state.
"""

from tokenwise.layers.fused_moe.experts import fused_experts
from tokenwise.layers.fused_moe.layer import FusedMoE
from tokenwise.layers.fused_moe.loading import (
    ExpertMapping,
    load_weights_with_experts,
    make_expert_params_mapping,
)
from tokenwise.layers.fused_moe.router import GroupedRouting, select_experts
from tokenwise.layers.fused_moe.sharding import ExpertShard

__all__ = [
    "ExpertMapping",
    "ExpertShard",
    "FusedMoE",
    "GroupedRouting",
    "fused_experts",
    "load_weights_with_experts",
    "make_expert_params_mapping",
    "select_experts",
]
