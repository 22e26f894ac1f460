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

Where PyTorch has a grouped matmul for the device and dtype (`torch._grouped_mm`: any dtype on
CPU, bf16 on Hopper and newer GPUs), the loop becomes two grouped matmuls whose group offsets
stay on the device: no host sync and two kernels per layer instead of two per expert (on an
H100 the loop kept a small MoE model's step waiting on the host). Results are the same to the
last bit on CPU; the loop remains for the other cases (fp32/fp16 on GPUs).

The loop needs each expert's group size on the host, which torch.compile cannot trace, so
models call the experts through one opaque custom op, `tokenwise::moe_experts` (like
attention's op), whichever path runs inside it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from tokenwise.layers.activation import SiluAndMul, SwigluOAIAndMul, get_act_and_mul
from tokenwise.layers.quantization.weight_only import QuantizedExperts


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
    use_grouped_mm: bool | None = None,
    quantized: QuantizedExperts | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`sum_k w[t,k] * expert_{id[t,k]}(x[t])` over the experts held in `w13` / `w2`.

    `w13` is `[E_local, 2*I, H]` (gate rows, then up rows), `w2` is `[E_local, H, I]`; local
    expert `j` is global expert `first_expert + j`. With `weights_in_fp32` the expert output is
    scaled by the float32 weights (Mixtral: the product is promoted to fp32 and rounded once);
    otherwise the weights are first rounded to the activation dtype (Qwen-MoE), and so is the
    product. The sum over a token's experts is float32 either way. `use_grouped_mm=None`
    picks the grouped matmul where `grouped_mm_supported` says it runs. `quantized` experts
    (`w13` / `w2` then only give shapes) run one at a time through their quantized layers.
    `w13_bias` `[E_local, 2*I]` / `w2_bias` `[E_local, H]` (gpt-oss) are added to each
    expert's projections before the routing weight scales its output.
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
    if quantized is not None:
        use_grouped_mm = False
    elif use_grouped_mm is None:
        use_grouped_mm = grouped_mm_supported(hidden_states) and _grouped_mm_fits(hidden_states, w2)
    if use_grouped_mm:
        pair_out = _grouped_pairs(
            hidden_states, w13, w2, local_ids, held, order, act_and_mul, w13_bias, w2_bias
        )
        pair_out = pair_out * weights[:, None]
        return pair_out.view(num_tokens, top_k, -1).to(acc_dtype).sum(1).to(hidden_states.dtype)
    counts = torch.bincount(local_ids, minlength=num_local + 1)[:num_local].tolist()
    sorted_tokens = order // top_k
    sorted_weights = weights[order]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        tokens = sorted_tokens[start : start + count]
        rows = hidden_states.index_select(0, tokens)
        if quantized is not None:
            gate_up = quantized.w13[expert].linear(rows, None)
            rows = quantized.w2[expert].linear(act_and_mul(gate_up), None)
        else:
            b13 = None if w13_bias is None else w13_bias[expert]
            b2 = None if w2_bias is None else w2_bias[expert]
            rows = F.linear(act_and_mul(F.linear(rows, w13[expert], b13)), w2[expert], b2)
        rows = rows * sorted_weights[start : start + count, None]
        out.index_add_(0, tokens, rows.to(acc_dtype))
        start += count
    return out.to(hidden_states.dtype)


def grouped_mm_supported(x: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` runs for `x`'s device and dtype."""
    return grouped_mm_available(x.device, x.dtype)


def grouped_mm_available(
    device: torch.device | str, dtype: torch.dtype, dims: tuple[int, ...] = ()
) -> bool:
    """CPU: any float dtype; CUDA: bf16 on compute capability 9.0 or newer (its only kernels
    in torch 2.11); and `dims` (hidden size, expert intermediate size) in 16-byte multiples.
    Where this holds the expert op never waits on the host, so a CUDA graph may hold it."""
    device = torch.device(device)
    if not hasattr(torch, "_grouped_mm"):
        return False
    itemsize = torch.empty((), dtype=dtype).element_size()
    if any(dim * itemsize % 16 for dim in dims):
        return False
    if device.type == "cpu":
        return True
    return (
        device.type == "cuda"
        and dtype == torch.bfloat16
        and torch.cuda.is_available()
        and torch.cuda.get_device_capability(device) >= (9, 0)
    )


def _grouped_mm_fits(hidden_states: torch.Tensor, w2: torch.Tensor) -> bool:
    """`torch._grouped_mm` needs every row stride in 16-byte multiples: the hidden size and
    this rank's expert intermediate size (small slices under TP/DP sharding may miss it)."""
    size = hidden_states.element_size()
    return all(dim * size % 16 == 0 for dim in (hidden_states.shape[-1], w2.shape[-1]))


def _grouped_pairs(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    local_ids: torch.Tensor,
    held: torch.Tensor,
    order: torch.Tensor,
    act_and_mul: Callable[[torch.Tensor], torch.Tensor],
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each (token, expert) pair's expert output, in pair order, unscaled; 0 for pairs whose
    expert another rank holds. Rows past the last local group are never computed by the
    grouped matmul (their contents are undefined), hence `where` rather than a product.
    Biases are gathered per sorted row (an absent expert's row takes any bias: it is zeroed)."""
    num_local = w13.shape[0]
    top_k = local_ids.numel() // hidden_states.shape[0]
    # Not bincount: on CUDA it reads the largest id on the host to size its output.
    counts = torch.zeros(num_local + 1, dtype=torch.int32, device=local_ids.device)
    counts.scatter_add_(0, local_ids, torch.ones_like(local_ids, dtype=torch.int32))
    offsets = torch.cumsum(counts[:num_local], 0, dtype=torch.int32)
    rows = hidden_states.index_select(0, order // top_k)
    row_expert = local_ids[order].clamp(max=num_local - 1)
    rows = torch._grouped_mm(rows, w13.transpose(1, 2), offs=offsets)
    if w13_bias is not None:
        rows = rows + w13_bias.index_select(0, row_expert)
    rows = torch._grouped_mm(act_and_mul(rows), w2.transpose(1, 2), offs=offsets)
    if w2_bias is not None:
        rows = rows + w2_bias.index_select(0, row_expert)
    rows = torch.where(
        held[order, None], rows, torch.zeros((), dtype=rows.dtype, device=rows.device)
    )
    pair_out = torch.empty_like(rows)
    pair_out[order] = rows
    return pair_out


SILU_AND_MUL = SiluAndMul()
# The experts' gated activations: SwiGLU ("silu", HF's "swish"), GeGLU with tanh GELU
# (Gemma 4, HF's "gelu_pytorch_tanh") and gpt-oss's clamped SwiGLU ("swigluoai", vLLM's name).
MOE_ACTIVATIONS = ("silu", "swish", "gelu_pytorch_tanh", "swigluoai")
GELU_TANH_AND_MUL = get_act_and_mul("gelu_pytorch_tanh")


def moe_act_and_mul(activation: str, alpha: float = 1.702, limit: float = 7.0) -> torch.nn.Module:
    """The gated activation of `MOE_ACTIVATIONS` on `[gate | up]` rows."""
    if activation in ("silu", "swish"):
        return SILU_AND_MUL
    if activation == "gelu_pytorch_tanh":
        return GELU_TANH_AND_MUL
    if activation == "swigluoai":
        return SwigluOAIAndMul(alpha, limit)
    raise ValueError(f"MoE activation must be one of {MOE_ACTIVATIONS}, got {activation!r}")


@torch.library.custom_op("tokenwise::moe_experts", mutates_args=())
def moe_experts(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    first_expert: int,
    weights_in_fp32: bool,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
) -> torch.Tensor:
    """`fused_experts` as one node for torch.compile; `activation` one of `MOE_ACTIVATIONS`
    (`alpha` / `limit`: swigluoai's), biases as in `fused_experts`."""
    return fused_experts(
        hidden_states,
        w13,
        w2,
        topk_weights,
        topk_ids,
        moe_act_and_mul(activation, alpha, limit),
        first_expert=first_expert,
        weights_in_fp32=weights_in_fp32,
        w13_bias=w13_bias,
        w2_bias=w2_bias,
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
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
) -> torch.Tensor:
    return torch.empty_like(hidden_states)
