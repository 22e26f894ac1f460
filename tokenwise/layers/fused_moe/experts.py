"""The expert computation: every (token, expert) pair, grouped by expert, one matmul pair each.

A token visits k experts, so there are T*k pairs. Sorting the pairs by expert turns "for each
token, for each of its experts" into "for each expert, all of its tokens at once": the Python
loop runs over experts (at most E of them per step, usually far fewer than tokens) and each
iteration is two dense matmuls over a contiguous block of rows. Results are scattered back
with `index_add_`, which sums a token's k contributions.

Rounding follows transformers' default (`grouped_mm`) experts path, so that bf16 models match it
bit for bit: each scaled expert output is formed in the dtype of `activations * weights` and the
k contributions are summed in float32, then rounded to the activation dtype once.

Pairs routed to experts this rank does not hold (expert parallelism) fall into a sentinel
bucket after the local ones and are never computed: their contribution comes from other ranks.

The loop needs each expert's group size on the host, which torch.compile cannot trace, so
models call it through one opaque custom op, `tokenwise::moe_experts` (like attention's op).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from tokenwise.layers.activation import SiluAndMul


def fused_experts(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    act_and_mul: Callable[[torch.Tensor], torch.Tensor],
    *,
    first_expert: int = 0,
    weights_in_fp32: bool = False,
) -> torch.Tensor:
    """`sum_k w[t,k] * expert_{id[t,k]}(x[t])` over the experts held in `w13` / `w2`.

    `w13` is `[E_local, 2*I, H]` (gate rows, then up rows), `w2` is `[E_local, H, I]`; local
    expert `j` is global expert `first_expert + j`. With `weights_in_fp32` the expert output is
    scaled by the float32 weights (Mixtral: the product is promoted to fp32 and rounded once);
    otherwise the weights are first rounded to the activation dtype (Qwen-MoE), and so is the
    product. The sum over a token's experts is float32 either way.
    """
    num_tokens, top_k = topk_ids.shape
    num_local = w13.shape[0]
    acc_dtype = torch.promote_types(hidden_states.dtype, torch.float32)
    out = torch.zeros(hidden_states.shape, dtype=acc_dtype, device=hidden_states.device)
    if num_tokens == 0:
        return out.to(hidden_states.dtype)
    weights = topk_weights.reshape(-1)
    if not weights_in_fp32:
        weights = weights.to(hidden_states.dtype)
    local_ids = topk_ids.reshape(-1) - first_expert
    held = (local_ids >= 0) & (local_ids < num_local)
    local_ids = torch.where(held, local_ids, torch.full_like(local_ids, num_local))
    # Stable, so each expert sees its tokens in token order (deterministic sums).
    order = torch.argsort(local_ids, stable=True)
    counts = torch.bincount(local_ids, minlength=num_local + 1)[:num_local].tolist()
    sorted_tokens = order // top_k
    sorted_weights = weights[order]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        tokens = sorted_tokens[start : start + count]
        rows = hidden_states.index_select(0, tokens)
        rows = F.linear(act_and_mul(F.linear(rows, w13[expert])), w2[expert])
        rows = rows * sorted_weights[start : start + count, None]
        out.index_add_(0, tokens, rows.to(acc_dtype))
        start += count
    return out.to(hidden_states.dtype)


_SILU_AND_MUL = SiluAndMul()


@torch.library.custom_op("tokenwise::moe_experts", mutates_args=())
def moe_experts(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    first_expert: int,
    weights_in_fp32: bool,
) -> torch.Tensor:
    """`fused_experts` with SiLU as one node for torch.compile (the only activation supported)."""
    return fused_experts(
        hidden_states,
        w13,
        w2,
        topk_weights,
        topk_ids,
        _SILU_AND_MUL,
        first_expert=first_expert,
        weights_in_fp32=weights_in_fp32,
    )


@moe_experts.register_fake
def _moe_experts_fake(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    first_expert: int,
    weights_in_fp32: bool,
) -> torch.Tensor:
    return torch.empty_like(hidden_states)
