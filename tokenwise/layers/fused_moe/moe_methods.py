"""The routed experts' methods (vLLM's `FusedMoEMethodBase`): dense, and int8 / int4 experts.

A `FusedMoE` layer asks the model's quantization config for its method while it is built
(`QuantizationConfig.get_quant_method`, vLLM's way: the method then creates the layer's
parameters, e.g. an MXFP4 method its blocks and scales), the dense one where the config has
none. int8 / int4 experts are made from the loaded dense weights instead: the layer switches to
`WeightOnlyFusedMoEMethod` when a config hands it quantized experts
(`FusedMoE.use_quantized_experts`). These methods live here, beside the expert loops they run,
rather than in `layers.quantization`, because that package sits below the MoE layer
(`tokenwise.tools.check_layers`); a method of another format subclasses `FusedMoEMethodBase`.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenwise.layers.fused_moe.experts import fused_experts, moe_act_and_mul, moe_experts
from tokenwise.layers.quantization.base_config import FusedMoEMethodBase


class UnquantizedFusedMoEMethod(FusedMoEMethodBase):
    """Experts in the model's dtype (`w13_weight`, `w2_weight`): the grouped matmul where it
    runs, else one expert at a time."""

    def create_weights(
        self, layer: nn.Module, num_local_experts: int, hidden_size: int, local_intermediate: int
    ) -> None:
        """`w13_weight [E_l, 2*I_l, H]` (gate rows, then up rows) and `w2_weight [E_l, H, I_l]`,
        filled by `FusedMoE.weight_loader`."""
        layer.w13_weight = nn.Parameter(
            torch.empty(num_local_experts, 2 * local_intermediate, hidden_size),
            requires_grad=False,
        )
        layer.w2_weight = nn.Parameter(
            torch.empty(num_local_experts, hidden_size, local_intermediate), requires_grad=False
        )

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
            activation=layer.activation,
        )


class WeightOnlyFusedMoEMethod(UnquantizedFusedMoEMethod):
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
            moe_act_and_mul(layer.activation),
            first_expert=layer.shard.first_expert,
            weights_in_fp32=layer.weights_in_fp32,
            quantized=layer.quant_experts,
        )


UNQUANTIZED_MOE = UnquantizedFusedMoEMethod()
WEIGHT_ONLY_MOE = WeightOnlyFusedMoEMethod()
