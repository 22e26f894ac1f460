"""The dense linear method: what every linear layer is built with, and keeps when unquantized.

`apply` is `cpu_prepack.linear`, which picks the device's route for the call: on the CPU
decode-sized calls through `native.gemv`'s small-M C kernel over the plain weight, others
through the oneDNN copy of the weight (held in the layer's `packed_weight`) when the layer has
one, else `F.linear`; on other devices, and under torch.compile, `F.linear`. A CPU graph
(`native.trace`) replays only the kernel calls, so this dispatch costs nothing there.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tokenwise.layers.cpu_prepack import linear
from tokenwise.layers.quantization.base_config import LinearMethodBase, QuantizationConfig


class UnquantizedLinearMethod(LinearMethodBase):
    """`y = x W^T + b` over the layer's dense `weight` (vLLM's name)."""

    def create_weights(
        self,
        layer: nn.Module,
        input_size: int,
        output_size: int,
        bias: bool,
        weight_loader: Callable[..., None],
    ) -> None:
        """`weight [output_size, input_size]` (and `bias`), in the default dtype and device,
        each filled from the checkpoint by `weight_loader`."""
        layer.packed_weight = None  # the oneDNN copy of `weight`, set by cpu_prepack on CPU
        layer.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        layer.weight.weight_loader = weight_loader
        if bias:
            layer.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            layer.bias.weight_loader = weight_loader
        else:
            layer.register_parameter("bias", None)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return linear(x, layer.weight, bias, layer.packed_weight)


UNQUANTIZED = UnquantizedLinearMethod()


class UnquantizedConfig(QuantizationConfig):
    """`quantization=None`: every layer keeps the dense method it was built with."""

    name = "none"

    def process_model(self, model: nn.Module) -> None:
        pass
