"""`BiasedFusedMoE`: routed experts with biases and gpt-oss's clamped SwiGLU, in gpt-oss's layout.

gpt-oss differs from the other MoE families in three ways this layer absorbs:

- every expert projection has a bias, and the down projection's bias is scaled by the routing
  weight with the rest of the expert's output (`fused_experts`' `w13_bias` / `w2_bias`);
- the activation is the clamped SwiGLU (`activation="swigluoai"`, vLLM's name);
- checkpoints stack all experts in one tensor per projection in the `x @ W` orientation, with
  gate and up *interleaved*: `gate_up_proj [E, H, 2I]` holds gate unit j in column 2j and up
  unit j in column 2j+1, `down_proj [E, I, H]`. They are stored here as `FusedMoE` stores
  experts (`w13 [E, 2I, H]` with gate rows then up rows, `w2 [E, H, I]`), so the intermediate
  dimension shards over TP / DP ranks exactly as for the other families.

Under sharding every rank computes a partial sum; the down bias must enter the total once, so
only the shard holding the first intermediate slice adds it (with expert parallelism, each
expert's owner). Weight formats other than dense floats (MXFP4) plug in as a `quant_method`
(`tokenwise.layers.quantization.mxfp4`): it creates its own parameters, loads the
checkpoint's tensors into them and computes the experts.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from tokenwise.config import EngineConfig
from tokenwise.layers.fused_moe.experts import (
    MOE_ACTIVATIONS,
    fused_experts,
    moe_act_and_mul,
    moe_experts,
)
from tokenwise.layers.fused_moe.layer import FusedMoE
from tokenwise.layers.fused_moe.router import select_experts
from tokenwise.layers.weight_utils import (
    CheckpointTensor,
    check_full_shape,
    deinterleave_rows,
    materialize,
)

# Checkpoint tensor (relative to the experts module) -> parameter, for dense weights.
DENSE_TENSORS = {
    "gate_up_proj": "w13_weight",
    "down_proj": "w2_weight",
    "gate_up_proj_bias": "w13_bias",
    "down_proj_bias": "w2_bias",
}


class BiasedFusedMoE(FusedMoE):
    """`FusedMoE` plus `w13_bias [E_l, 2*I_l]`, `w2_bias [E_l, H]`, the swigluoai activation
    and an optional `quant_method` that owns the expert weights' format."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        config: EngineConfig,
        *,
        activation: str = "swigluoai",
        swiglu_alpha: float = 1.702,
        swiglu_limit: float = 7.0,
        quant_method: Any = None,
        prefix: str = "",
    ) -> None:
        # gpt-oss: softmax over the top-k logits, i.e. the top-k probabilities renormalised.
        # With a quant_method the dense weights are never used: made on the meta device (no
        # memory, not even for a moment on a GPU), then replaced by the method's parameters.
        with torch.device("meta") if quant_method is not None else nullcontext():
            super().__init__(
                num_experts,
                top_k,
                hidden_size,
                intermediate_size,
                config,
                renormalize=True,
                weights_in_fp32=True,
                prefix=prefix,
            )
        if activation not in MOE_ACTIVATIONS:
            raise ValueError(f"activation must be one of {MOE_ACTIVATIONS}, got {activation!r}")
        self.activation, self.alpha, self.limit = activation, swiglu_alpha, swiglu_limit
        local_e, local_i = self.shard.num_local_experts, self.shard.local_intermediate_size
        self.w13_bias = nn.Parameter(torch.empty(local_e, 2 * local_i), requires_grad=False)
        self.w2_bias = nn.Parameter(torch.empty(local_e, hidden_size), requires_grad=False)
        # Only one shard of the intermediate dimension adds the down bias (see the module doc).
        self.adds_down_bias = self.shard.intermediate_start == 0
        self.quant_method = quant_method
        if quant_method is not None:
            del self.w13_weight, self.w2_weight
            quant_method.create_weights(self)

    def forward_local(
        self, hidden_states: torch.Tensor, router_logits: torch.Tensor
    ) -> torch.Tensor:
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, True)
        w2_bias = self.w2_bias if self.adds_down_bias else None
        if self.quant_method is not None:
            return self.quant_method.apply(self, hidden_states, topk_weights, topk_ids, w2_bias)
        if torch.compiler.is_compiling():
            return moe_experts(
                hidden_states,
                self.w13_weight,
                self.w2_weight,
                topk_weights,
                topk_ids,
                self.shard.first_expert,
                True,
                self.w13_bias,
                w2_bias,
                self.activation,
                self.alpha,
                self.limit,
            )
        return fused_experts(
            hidden_states,
            self.w13_weight,
            self.w2_weight,
            topk_weights,
            topk_ids,
            self.act_and_mul,
            first_expert=self.shard.first_expert,
            weights_in_fp32=True,
            w13_bias=self.w13_bias,
            w2_bias=w2_bias,
        )

    @property
    def act_and_mul(self) -> nn.Module:
        return moe_act_and_mul(self.activation, self.alpha, self.limit)

    def load_stacked(self, name: str, loaded: CheckpointTensor) -> str:
        """Load the checkpoint tensor `name` (relative to the experts module, e.g.
        `gate_up_proj_bias`) into this rank's part of its parameter; returns the parameter's
        name. Unknown names are refused, naming the ones this layer takes."""
        s = self.shard
        experts = slice(s.first_expert, s.first_expert + s.num_local_experts)
        size, cols = s.intermediate_size, s.intermediate_slice()
        if self.quant_method is not None and name not in ("gate_up_proj_bias", "down_proj_bias"):
            return self.quant_method.load_stacked(self, name, loaded)
        if name not in DENSE_TENSORS:
            raise ValueError(
                f"unexpected expert tensor {name!r}; expected one of {', '.join(DENSE_TENSORS)}"
            )
        param_name = DENSE_TENSORS[name]
        param = getattr(self, param_name)
        expected = {
            "gate_up_proj": (s.num_experts, self.hidden_size, 2 * size),
            "down_proj": (s.num_experts, size, self.hidden_size),
            "gate_up_proj_bias": (s.num_experts, 2 * size),
            "down_proj_bias": (s.num_experts, self.hidden_size),
        }[name]
        check_full_shape(loaded, expected)
        t = materialize(loaded)[experts]
        if name == "gate_up_proj":
            t = deinterleave_rows(t.transpose(1, 2))
            t = torch.cat([t[:, :size][:, cols], t[:, size:][:, cols]], dim=1)
        elif name == "gate_up_proj_bias":
            t = deinterleave_rows(t)
            t = torch.cat([t[:, :size][:, cols], t[:, size:][:, cols]], dim=1)
        elif name == "down_proj":
            t = t.transpose(1, 2)[:, :, cols]
        with torch.no_grad():
            param.copy_(t)
        return param_name

    def extra_repr(self) -> str:
        method = type(self.quant_method).__name__ if self.quant_method is not None else "dense"
        return f"{super().extra_repr()}, activation={self.activation}, weights={method}"
