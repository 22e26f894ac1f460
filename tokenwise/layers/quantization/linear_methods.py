"""The quantized linear methods: int8 / int4 weight-only and FP8, each computing with the
quantized weight its layer holds in `quant_weight`.

Every format tokenwise reads ends in one of the two: int8 / int4 on load, a GGUF file's blocks
(Q8_0, Q4_0, Q4_1 and the K-quants, exact), GPTQ's, AWQ's and compressed-tensors' integers are
`QuantizedWeight`s (or `QuantizedParts`, a fused layer whose parts differ); an "fp8" checkpoint,
FP8 on load and compressed-tensors FP8 layers are `FP8Weight`s. The weight object carries the
device choice: on the CPU the C kernels (`native.qgemv`, `native.fp8_gemv`) for decode-sized
calls and the weight dequantized for torch's matmul beyond; on a CUDA GPU torch's int4 kernel
where the load-time self-check passed (`gpu_selfcheck`), else dequantized per call.

`apply` is one call into that object: the method adds no Python to a step beyond the one
attribute read of the layer's `quant_method`, and nothing at all to a replayed CPU graph.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenwise.layers.quantization.base_config import LinearMethodBase


class _QuantizedLinearMethod(LinearMethodBase):
    """A method over `layer.quant_weight`, an object with `linear(x, bias)`."""

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return layer.quant_weight.linear(x, bias)


class WeightOnlyLinearMethod(_QuantizedLinearMethod):
    """Group-quantized int8 / int4 weights, activations in floating point
    (`weight_only.QuantizedWeight` / `QuantizedParts`)."""


class FP8LinearMethod(_QuantizedLinearMethod):
    """float8_e4m3fn weights with per-tensor, per-channel or block scales (`fp8.FP8Weight`, or a
    fused layer's `QuantizedParts` of them)."""


WEIGHT_ONLY = WeightOnlyLinearMethod()
FP8_LINEAR = FP8LinearMethod()


def use_quantized_weight(layer: nn.Module, method: LinearMethodBase, weight: Any) -> None:
    """Give a linear layer its quantized `weight` and the `method` that computes with it (the
    caller moves the dense weight away: it may be shared with a tied embedding)."""
    layer.quant_weight = weight
    layer.quant_method = method
