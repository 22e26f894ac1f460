"""The routed experts' methods (vLLM's `FusedMoEMethodBase`): dense, and int8 / int4 experts.

A `FusedMoE` layer is built with the dense method and switches to the quantized one when a
quantization config hands it quantized experts (`FusedMoE.use_quantized_experts`). The methods
live here, beside the expert loops they run, rather than in `layers.quantization`, because that
package sits below the MoE layer (`tokenwise.tools.check_layers`); a method for another format
(MXFP4) subclasses `FusedMoEMethodBase` and is set as the layer's `quant_method` the same way.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenwise.layers.fused_moe.experts import SILU_AND_MUL, fused_experts, moe_experts
from tokenwise.layers.quantization.base_config import FusedMoEMethodBase


class UnquantizedFusedMoEMethod(FusedMoEMethodBase):
    """Experts in the model's dtype (`w13_weight`, `w2_weight`): the grouped matmul where it
    runs, else one expert at a time."""

    def apply(
        self,
        layer: nn.Module,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        return moe_experts(
            hidden_states,
            layer.w13_weight,
            layer.w2_weight,
            topk_weights,
            topk_ids,
            layer.shard.first_expert,
            layer.weights_in_fp32,
        )


class WeightOnlyFusedMoEMethod(FusedMoEMethodBase):
    """Each expert's weights int8 / int4 (`layer.quant_experts`), run one expert at a time
    through their quantized products (eager only, as every quantized layer)."""

    def apply(
        self,
        layer: nn.Module,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        return fused_experts(
            hidden_states,
            layer.w13_weight,
            layer.w2_weight,
            topk_weights,
            topk_ids,
            SILU_AND_MUL,
            first_expert=layer.shard.first_expert,
            weights_in_fp32=layer.weights_in_fp32,
            quantized=layer.quant_experts,
        )


UNQUANTIZED_MOE = UnquantizedFusedMoEMethod()
WEIGHT_ONLY_MOE = WeightOnlyFusedMoEMethod()
