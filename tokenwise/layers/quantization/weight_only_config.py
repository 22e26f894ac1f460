"""The configs of the integer methods' common part, and of `int8` / `int4` on load.

Every integer method (int8 / int4 on load, GGUF, GPTQ, AWQ, compressed-tensors) ends the same
way, so `IntegerConfig.finish` does it once: on a CUDA GPU the quantized weights move to the
device and each format's route is chosen there (`gpu_selfcheck`: torch's int4 kernel where it
proved right, else dequantized per call); routed experts stay dense off the CPU (their quantized
loop runs one expert at a time, outside the MoE op that graphs capture). Where integers are not
kept (`quantization_config.keeps_integers`: devices other than the CPU and CUDA), the format
readers still run and the layers stay dense in the model's dtype.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from tokenwise.layers.quantization.base_config import QuantizationConfig
from tokenwise.layers.quantization.gpu_selfcheck import prepare_model
from tokenwise.layers.quantization.schemes import (
    INT4,
    INT8,
    Scheme,
    on_load_scheme,
    quantize_experts,
    quantize_model,
)
from tokenwise.model_config import ModelConfig
from tokenwise.quantization_config import keeps_integers

logger = logging.getLogger(__name__)


class IntegerConfig(QuantizationConfig):
    """A method whose layers keep int8 / int4 integers (`linear_methods.WEIGHT_ONLY`)."""

    def __init__(self, model_config: ModelConfig, device: torch.device) -> None:
        super().__init__(model_config, device)
        self.keep_ints = keeps_integers(model_config.quantization, str(device))

    def finish(self, model: nn.Module) -> None:
        """After the layers got their methods: the device's routes (see the module docstring)."""
        if not self.keep_ints or self.on_cpu:
            return
        if any(hasattr(m, "quant_experts") for m in model.modules()):
            logger.info("routed experts stay in the model's dtype off the CPU (not quantized)")
        prepare_model(model, self.device, self.model_config.dtype)


class WeightOnlyOnLoadConfig(IntegerConfig):
    """A float checkpoint rounded to `scheme` as it loads: every linear layer but the MoE
    routers, the LM head and the token embedding, and on the CPU the routed experts."""

    scheme: Scheme

    def process_model(self, model: nn.Module) -> None:
        quantize_model(model, on_load_scheme(self.scheme))
        if self.on_cpu:
            quantize_experts(model, self.scheme)
        self.finish(model)


class Int8Config(WeightOnlyOnLoadConfig):
    """`quantization="int8"`: symmetric, groups of 32 (GGUF's Q8_0)."""

    name = "int8"
    scheme = INT8


class Int4Config(WeightOnlyOnLoadConfig):
    """`quantization="int4"`: with offsets, groups of 64 (Q4_1's form)."""

    name = "int4"
    scheme = INT4
