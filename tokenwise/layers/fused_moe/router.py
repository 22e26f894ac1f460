"""Top-k routing: which experts each token visits and with what weight.

The order of operations is Hugging Face's, because greedy tokens depend on it: softmax over
*all* experts in float32 (whatever the activation dtype), then top-k, then (optionally) divide
the k weights by their sum. Renormalising after the top-k is not the same as a softmax over
the k chosen logits only when done in another order or dtype, so it is spelled out here once.
"""

from __future__ import annotations

import torch


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(topk_weights [T, k] float32, topk_ids [T, k] int64)` for router logits `[T, E]`.

    The weights stay float32: each model decides whether they are rounded to the activation
    dtype before scaling the expert outputs (Qwen-MoE rounds, Mixtral does not).
    """
    num_experts = router_logits.shape[-1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
    probs = torch.softmax(router_logits.float(), dim=-1)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids.to(torch.int64)
