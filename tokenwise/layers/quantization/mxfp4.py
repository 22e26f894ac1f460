"""MXFP4 expert weights, as gpt-oss publishes them: loaded and kept 4-bit, computed from them.

The format (OCP microscaling FP4; transformers' `integrations/mxfp4.py` reads the same bytes):
each row of a weight is cut into groups of 32 values; a group is 16 bytes of e2m1 codes, two
per byte (value 2j in byte j's low nibble, 2j+1 in its high one; a code is a sign bit and one
of the magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6) and one e8m0 scale byte s, the power of two
2^(s - 127). A checkpoint stores every expert of a layer in two tensors per projection:
`gate_up_proj_blocks [E, 2I, H/32, 16]` + `gate_up_proj_scales [E, 2I, H/32]` (rows of the
`[2I, H]` weight, gate and up rows interleaved as in the dense checkpoint) and
`down_proj_blocks [E, H, I/32, 16]` + `down_proj_scales [E, H, I/32]`. The biases stay float
(`*_proj_bias`); so do attention, router, embeddings and head (`modules_to_not_convert`).

`Mxfp4MoEMethod` is shaped like vLLM's `FusedMoEMethodBase`: `create_weights` gives a
`BiasedFusedMoE` uint8 parameters for this rank's experts and intermediate slice (no dense
weights ever exist), `load_stacked` copies the checkpoint's bytes in (gate/up rows
de-interleaved like the dense ones; an intermediate slice under TP is whole groups),
`process_weights_after_loading` has nothing to convert (the kernel reads the published layout)
and `apply` runs the experts: on the CPU the C kernel (`native/mxfp4_gemv.c`) for up to 8 rows
an expert, otherwise (prefill rows, GPUs) the expert's weights dequantized for the call and a
dense matmul; there is no GPU MXFP4 kernel yet.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenwise.layers.quantization.unquantized import UnquantizedConfig
from tokenwise.layers.weight_utils import (
    CheckpointTensor,
    check_full_shape,
    deinterleave_rows,
    materialize,
)
from tokenwise.native import mxfp4_gemv as kernel

# The layer these methods serve (`fused_moe.biased.BiasedFusedMoE`, above this package).
BiasedFusedMoE = Any

MXFP4 = "mxfp4"
GROUP = 32
E2M1_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
# Checkpoint tensor (relative to the experts module) -> this method's parameter.
TENSORS = {
    "gate_up_proj_blocks": "w13_blocks",
    "gate_up_proj_scales": "w13_scales",
    "down_proj_blocks": "w2_blocks",
    "down_proj_scales": "w2_scales",
}


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`[..., N, G, 16]` codes and `[..., N, G]` scales -> `[..., N, 32 G]` values in `dtype`:
    the definition every MXFP4 path here is tested against."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    pairs = torch.stack([lut[(blocks & 15).long()], lut[(blocks >> 4).long()]], dim=-1)
    values = torch.ldexp(pairs.flatten(-2), (scales.to(torch.int32) - 127)[..., None].float())
    return values.flatten(-2).to(dtype)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float `[..., N, K]` (K a multiple of 32) -> `(blocks, scales)` in the published layout:
    each group's scale is the smallest power of two that brings its largest magnitude within
    6, and every value rounds to the nearest e2m1 magnitude. For tests and benchmarks (gpt-oss
    ships its experts already quantized)."""
    *lead, k = weight.shape
    if k % GROUP:
        raise ValueError(f"MXFP4 needs rows of a multiple of {GROUP} values, got {k}")
    groups = weight.float().reshape(*lead, k // GROUP, GROUP)
    amax = groups.abs().amax(-1).clamp(min=2.0**-126)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)[..., None]
    mags = torch.tensor(E2M1_VALUES[:8])
    codes = (scaled.abs()[..., None] - mags).abs().argmin(-1)
    codes = codes | ((scaled < 0) & (codes > 0)).long() << 3
    codes = codes.to(torch.uint8).reshape(*lead, k // GROUP, 16, 2)
    blocks = codes[..., 0] | (codes[..., 1] << 4)
    return blocks.contiguous(), (exponent + 127).to(torch.uint8).contiguous()


def mxfp4_method_for(config: Any) -> Mxfp4MoEMethod | None:
    """The experts' method of a model loaded with `quantization="mxfp4"`, else None."""
    return Mxfp4MoEMethod() if config.model.quantization == MXFP4 else None


def mxfp4_linear(
    x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """`x @ dequant(W)^T + bias` in x's dtype: the C kernel for up to 8 CPU rows, else the
    weights dequantized for this call."""
    if x.device.type == "cpu" and x.shape[0] <= kernel.MAX_ROWS:
        lib = kernel.load()
        if lib is not None:
            b = None if bias is None else bias.float().contiguous()
            return kernel.mxfp4_gemv(lib, x.float(), blocks, scales, b).to(x.dtype)
    return F.linear(x, dequantize(blocks, scales, x.dtype), bias)


class Mxfp4MoEMethod:
    """The MXFP4 weights of one `BiasedFusedMoE` (vLLM's `FusedMoEMethodBase` interface)."""

    def create_weights(self, layer: BiasedFusedMoE) -> None:
        s, hidden = layer.shard, layer.hidden_size
        if hidden % GROUP or s.local_intermediate_size % GROUP or s.intermediate_start % GROUP:
            raise ValueError(
                f"MXFP4 experts need hidden_size ({hidden}) and each rank's slice of "
                f"intermediate_size ({s.intermediate_size} over {s.intermediate_size // s.local_intermediate_size} "
                f"shards) in multiples of {GROUP}"
            )
        e, i = s.num_local_experts, s.local_intermediate_size

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(shape, dtype=torch.uint8), requires_grad=False)

        layer.w13_blocks = param(e, 2 * i, hidden // GROUP, 16)
        layer.w13_scales = param(e, 2 * i, hidden // GROUP)
        layer.w2_blocks = param(e, hidden, i // GROUP, 16)
        layer.w2_scales = param(e, hidden, i // GROUP)

    def load_stacked(self, layer: BiasedFusedMoE, name: str, loaded: CheckpointTensor) -> str:
        """Copy this rank's part of the checkpoint tensor `name` (relative to the experts
        module); returns the parameter's name."""
        if name not in TENSORS:
            raise ValueError(
                f"an MXFP4 checkpoint's experts hold {', '.join(TENSORS)} and biases; "
                f"got {name!r} (a dense expert tensor in a checkpoint whose config says mxfp4?)"
            )
        s, hidden = layer.shard, layer.hidden_size
        size, cols = s.intermediate_size, s.intermediate_slice()
        experts = slice(s.first_expert, s.first_expert + s.num_local_experts)
        gate_up = name.startswith("gate_up")
        rows, width = (2 * size, hidden) if gate_up else (hidden, size)
        shape = (s.num_experts, rows, width // GROUP) + ((16,) if name.endswith("blocks") else ())
        check_full_shape(loaded, shape)
        t = materialize(loaded)[experts]
        if gate_up:  # rows: de-interleave, then this rank's gate rows and up rows
            t = deinterleave_rows(t)
            t = torch.cat([t[:, :size][:, cols], t[:, size:][:, cols]], dim=1)
        else:  # columns: this rank's whole groups
            t = t[:, :, cols.start // GROUP : cols.stop // GROUP]
        param_name = TENSORS[name]
        with torch.no_grad():
            getattr(layer, param_name).copy_(t)
        return param_name

    def process_weights_after_loading(self, layer: BiasedFusedMoE) -> None:
        """Nothing to convert: the CPU kernel reads the published layout as it is."""

    def apply(
        self,
        layer: BiasedFusedMoE,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        w2_bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """The experts' weighted sum, one local expert at a time (its tokens together)."""
        num_tokens, top_k = topk_ids.shape
        out = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
        local = topk_ids.reshape(-1) - layer.shard.first_expert
        num_local = layer.shard.num_local_experts
        held = (local >= 0) & (local < num_local)
        local = torch.where(held, local, torch.full_like(local, num_local))
        order = torch.argsort(local, stable=True)
        counts = torch.bincount(local, minlength=num_local + 1)[:num_local].tolist()
        weights = topk_weights.reshape(-1)[order].float()
        tokens_sorted = order // top_k
        act = layer.act_and_mul
        start = 0
        for e, count in enumerate(counts):
            if count == 0:
                continue
            tokens = tokens_sorted[start : start + count]
            rows = hidden_states.index_select(0, tokens)
            h = mxfp4_linear(rows, layer.w13_blocks[e], layer.w13_scales[e], layer.w13_bias[e])
            b2 = None if w2_bias is None else w2_bias[e]
            rows = mxfp4_linear(act(h), layer.w2_blocks[e], layer.w2_scales[e], b2)
            out.index_add_(0, tokens, rows.float() * weights[start : start + count, None])
            start += count
        return out.to(hidden_states.dtype)


class Mxfp4Config(UnquantizedConfig):
    """`quantization="mxfp4"` (gpt-oss as published): the linear layers stay dense, and the
    experts take the model's MXFP4 method (`mxfp4_method_for`), which reads `*_blocks` and
    `*_scales` itself."""

    name = "mxfp4"
