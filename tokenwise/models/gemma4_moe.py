"""Gemma 4's mixture-of-experts block (the 26B-A4B model: `enable_moe_block`).

Each layer keeps its dense MLP and adds routed experts beside it; the two outputs are normed
separately (`post_feedforward_layernorm_1` / `_2`) and summed before the layer's usual
post-feed-forward norm. What differs from the other MoE families, and where it is handled:
- the router reads the residual stream itself (not the MLP's normed input) through a
  scale-free RMSNorm, a learned per-channel `scale` and `hidden_size ** -0.5`, then a plain
  projection: `Gemma4Router` computes those logits;
- top-k over the softmax, renormalised, then multiplied by a learned `per_expert_scale` of the
  chosen experts: `Gemma4Experts.forward_local` applies it after `select_experts`, so the data
  parallel exchange (which routes from the logits on the receiving rank) applies it too;
- the experts are GeGLU (`gelu_pytorch_tanh`), not SwiGLU (`FusedMoE(hidden_act=...)`).
The checkpoint stores the experts stacked (`experts.gate_up_proj [E, 2I, H]`,
`experts.down_proj [E, H, I]`), which `FusedMoE.weight_loader` reads as its `w13` / `w2`.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenwise.config import EngineConfig
from tokenwise.layers import ReplicatedLinear
from tokenwise.layers.fused_moe import FusedMoE, select_experts
from tokenwise.layers.layernorm import Gemma4RMSNorm


class Gemma4Router(nn.Module):
    """Router logits from the residual stream (see the module docstring)."""

    def __init__(self, hidden_size: int, num_experts: int, eps: float) -> None:
        super().__init__()
        self.norm = Gemma4RMSNorm(hidden_size, eps, with_scale=False)
        self.scale = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.proj = ReplicatedLinear(hidden_size, num_experts)
        self.per_expert_scale = nn.Parameter(torch.ones(num_experts), requires_grad=False)
        self.root_size = float(hidden_size) ** -0.5

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(hidden_states) * self.scale * self.root_size)


class Gemma4Experts(FusedMoE):
    """`FusedMoE` with GeGLU experts and routing weights times the router's per-expert scale."""

    def __init__(self, config: EngineConfig, router: Gemma4Router, prefix: str) -> None:
        hf = config.model.hf_config
        if config.parallel.data_parallel_size > 1:
            raise NotImplementedError(
                "Gemma 4 with enable_moe_block under data_parallel_size > 1 is not supported"
            )
        super().__init__(
            int(hf.num_experts),
            int(hf.top_k_experts),
            int(hf.hidden_size),
            int(hf.moe_intermediate_size),
            config,
            renormalize=True,
            hidden_act="gelu_pytorch_tanh",
            weights_in_fp32=True,
            prefix=prefix,
        )
        self._router = [router]  # not a submodule: loaded (and named) under `router`

    def forward_local(
        self, hidden_states: torch.Tensor, router_logits: torch.Tensor
    ) -> torch.Tensor:
        weights, ids = select_experts(router_logits, self.top_k, renormalize=True)
        weights = weights * self._router[0].per_expert_scale.float()[ids]
        return self.run_experts(hidden_states, weights, ids)


# Checkpoint name (after `experts.`) -> (parameter, FusedMoE shard id).
EXPERT_TENSORS = {"gate_up_proj": ("w13_weight", "w13"), "down_proj": ("w2_weight", "w2")}
