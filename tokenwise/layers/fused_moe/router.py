"""Top-k routing: which experts each token visits and with what weight.

The order of operations is Hugging Face's, because greedy tokens depend on it: softmax over
*all* experts in float32 (whatever the activation dtype), then top-k, then (optionally) divide
the k weights by their sum. Renormalising after the top-k is not the same as a softmax over
the k chosen logits only when done in another order or dtype, so it is spelled out here once.

DeepSeek adds three things, described by `GroupedRouting` (vLLM's names):

- group-limited routing: the experts form `num_expert_group` groups, each token first keeps its
  best `topk_group` groups and picks its k experts inside them only (on a real deployment the
  groups are devices, so this bounds the devices a token talks to). DeepSeek-V2 scores a group
  by its best expert and zeroes the others (`topk_method="group_limited_greedy"`).
- DeepSeek-V3 (`noaux_tc`): sigmoid scores instead of a softmax, and a learnt per-expert
  `e_score_correction_bias` that is added for *choosing* (experts and groups, a group scored by
  its two best) but not for weighting: it balances load without touching the output scale.
- `routed_scaling_factor`: the k weights are multiplied by it at the end.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCORING_FUNCS = ("softmax", "sigmoid")


@dataclass
class GroupedRouting:
    """DeepSeek's routing options; the defaults are plain top-k over a softmax.

    `e_score_correction_bias` is a reference to the router's parameter (filled in place when
    weights load), not a copy: a plain dataclass, so that `FusedMoE` does not register it as a
    parameter of its own under a second name.
    """

    scoring_func: str = "softmax"
    num_expert_group: int | None = None
    topk_group: int | None = None
    e_score_correction_bias: torch.Tensor | None = None
    routed_scaling_factor: float = 1.0

    def check(self, num_experts: int, top_k: int) -> None:
        """Refuse settings that cannot route, naming the parameter and its range."""
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(
                f"scoring_func must be one of {', '.join(SCORING_FUNCS)}, got {self.scoring_func!r}"
            )
        if self.num_expert_group is None:
            return
        groups = self.num_expert_group
        if groups < 1 or num_experts % groups:
            raise ValueError(
                f"n_group ({groups}) must be >= 1 and divide the number of experts ({num_experts})"
            )
        if self.topk_group is None or not 1 <= self.topk_group <= groups:
            raise ValueError(f"topk_group must be in [1, n_group={groups}], got {self.topk_group}")
        if top_k > self.topk_group * (num_experts // groups):
            raise ValueError(
                f"top_k ({top_k}) exceeds the experts in topk_group={self.topk_group} groups of "
                f"{num_experts // groups}"
            )


def _group_mask(choice: torch.Tensor, routing: GroupedRouting) -> torch.Tensor:
    """`[T, E]` bool: the experts inside each token's `topk_group` best groups."""
    groups = routing.num_expert_group
    assert groups is not None and routing.topk_group is not None
    per_group = choice.view(choice.shape[0], groups, -1)
    if routing.e_score_correction_bias is not None:
        group_scores = per_group.topk(2, dim=-1).values.sum(dim=-1)  # V3: the two best experts
    else:
        group_scores = per_group.max(dim=-1).values  # V2: the best expert
    best = torch.topk(group_scores, routing.topk_group, dim=-1, sorted=False).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return keep.unsqueeze(-1).expand_as(per_group).reshape(choice.shape)


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    routing: GroupedRouting | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(topk_weights [T, k] float32, topk_ids [T, k] int64)` for router logits `[T, E]`.

    The weights stay float32: each model decides whether they are rounded to the activation
    dtype before scaling the expert outputs (Qwen-MoE rounds, Mixtral does not).
    """
    num_experts = router_logits.shape[-1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
    if routing is None:
        probs = torch.softmax(router_logits.float(), dim=-1)
        topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
        if renormalize:
            topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        return topk_weights, topk_ids.to(torch.int64)
    logits = router_logits.float()
    scores = torch.sigmoid(logits) if routing.scoring_func == "sigmoid" else logits.softmax(-1)
    choice = scores
    if routing.e_score_correction_bias is not None:
        choice = scores + routing.e_score_correction_bias.float()
    if routing.num_expert_group is not None:
        # Experts outside the kept groups can never win: -inf under a bias (choice scores may
        # be negative), 0 for plain probabilities (as DeepSeek-V2 writes it).
        masked = float("-inf") if routing.e_score_correction_bias is not None else 0.0
        choice = choice.masked_fill(~_group_mask(choice, routing), masked)
    topk_ids = torch.topk(choice, top_k, dim=-1).indices
    topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    if routing.routed_scaling_factor != 1.0:
        topk_weights = topk_weights * routing.routed_scaling_factor
    return topk_weights, topk_ids.to(torch.int64)
