"""DeepSeek's MoE block: a router, routed experts (`FusedMoE`) and always-on shared experts.

What differs from Qwen2-MoE's block, and why it has its own file:

- the router logits are computed in float32 from float32 weights, as DeepSeek does (a bf16
  model would otherwise pick other experts on near ties);
- routing is DeepSeek's (`GroupedRouting`): V2 takes a softmax, optionally limited to the best
  `topk_group` of `n_group` expert groups (`topk_method="group_limited_greedy"`), and never
  renormalises the k weights (transformers' DeepSeek-V2 ignores `norm_topk_prob`); V3 scores
  with a sigmoid plus the learnt `e_score_correction_bias` for choosing, always grouped, and
  renormalises when `norm_topk_prob`. Both multiply by `routed_scaling_factor`;
- the `n_shared_experts` shared experts are one dense SwiGLU MLP of `n_shared_experts *
  moe_intermediate_size`, added without a gate.

Under tensor parallelism (and DP x TP) the routed experts are sharded by `FusedMoE` (slices of
every expert's intermediate dimension, or whole experts with expert parallelism) and the shared
experts like a dense MLP (their intermediate dimension split over the TP ranks). Both outputs
are then partial sums over the same tokens, so they are added first and all-reduced once, not
once each. The router is replicated: every rank routes every token identically.

Module names follow the checkpoints (`mlp.gate.weight`, `mlp.gate.e_score_correction_bias`,
`mlp.experts.<e>.gate_proj.weight`, `mlp.shared_experts.gate_proj.weight`, ...).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenwise.config import EngineConfig
from tokenwise.distributed.tp_state import get_tp_size, tp_all_reduce
from tokenwise.layers.fused_moe import FusedMoE, GroupedRouting
from tokenwise.models.llama import LlamaMLP

TOPK_METHODS = ("greedy", "group_limited_greedy")


class DeepseekRouter(nn.Module):
    """Router logits in float32 from a float32 weight; V3 also owns the per-expert choice bias
    (float32 too).

    The weight is stored in float32 whatever the model's dtype, as transformers keeps it
    (`_keep_in_fp32_modules_strict = ["gate.weight"]`): a float32 checkpoint's router would
    otherwise be rounded to bf16 on load, moving bf16 models' logits by ~1e-2 and, on near
    ties, their top-k experts.
    """

    def __init__(self, hidden_size: int, num_experts: int, with_bias: bool) -> None:
        super().__init__()
        weight = torch.empty(num_experts, hidden_size, dtype=torch.float32)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.e_score_correction_bias: nn.Parameter | None = None
        if with_bias:
            bias = torch.zeros(num_experts, dtype=torch.float32)
            self.e_score_correction_bias = nn.Parameter(bias, requires_grad=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden_states.float(), self.weight.float())


def deepseek_routing(hf: Any, router: DeepseekRouter, is_v3: bool) -> tuple[GroupedRouting, bool]:
    """`(routing, renormalize)` for a DeepSeek config, checked with the config's names."""
    scaling = float(getattr(hf, "routed_scaling_factor", 1.0) or 1.0)
    if is_v3:
        routing = GroupedRouting(
            scoring_func="sigmoid",
            num_expert_group=int(hf.n_group),
            topk_group=int(hf.topk_group),
            e_score_correction_bias=router.e_score_correction_bias,
            routed_scaling_factor=scaling,
        )
        return routing, bool(getattr(hf, "norm_topk_prob", False))
    method = getattr(hf, "topk_method", None) or "greedy"
    if method not in TOPK_METHODS:
        raise ValueError(
            f"topk_method must be one of {', '.join(TOPK_METHODS)} for DeepSeek-V2, got {method!r}"
        )
    grouped = method == "group_limited_greedy"
    routing = GroupedRouting(
        scoring_func="softmax",
        num_expert_group=int(hf.n_group) if grouped else None,
        topk_group=int(hf.topk_group) if grouped else None,
        routed_scaling_factor=scaling,
    )
    return routing, False


class DeepseekMoE(nn.Module):
    """Routed experts plus the shared experts, for one decoder layer."""

    def __init__(self, config: EngineConfig, prefix: str, is_v3: bool) -> None:
        super().__init__()
        hf = config.model.hf_config
        num_experts = int(hf.n_routed_experts)
        intermediate = int(hf.moe_intermediate_size)
        self.gate = DeepseekRouter(hf.hidden_size, num_experts, with_bias=is_v3)
        routing, renormalize = deepseek_routing(hf, self.gate, is_v3)
        self.experts = FusedMoE(
            num_experts,
            int(hf.num_experts_per_tok),
            hf.hidden_size,
            intermediate,
            config,
            renormalize=renormalize,
            hidden_act=hf.hidden_act,
            weights_in_fp32=True,  # the expert outputs are scaled by the float32 weights
            prefix=f"{prefix}.experts",
            routing=routing,
        )
        shared = int(getattr(hf, "n_shared_experts", 0) or 0)
        bias = bool(getattr(hf, "mlp_bias", False))
        # One all-reduce for routed + shared under TP; a biased shared MLP must add its bias
        # after its own reduce, so it keeps reducing itself (DeepSeek's MLPs have no bias).
        self.reduce_once = shared > 0 and not bias and get_tp_size() > 1
        self.shared_experts: LlamaMLP | None = None
        if shared:
            self.shared_experts = LlamaMLP(
                hf.hidden_size,
                intermediate * shared,
                hf.hidden_act,
                bias,
                reduce_results=not self.reduce_once,
                size_name="n_shared_experts * moe_intermediate_size",
            )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        router_logits = self.gate(hidden_states)
        if self.reduce_once:
            assert self.shared_experts is not None
            routed = self.experts.forward_partial(hidden_states, router_logits)
            return tp_all_reduce(routed + self.shared_experts(hidden_states))
        routed = self.experts(hidden_states, router_logits)
        if self.shared_experts is None:
            return routed
        return routed + self.shared_experts(hidden_states)
