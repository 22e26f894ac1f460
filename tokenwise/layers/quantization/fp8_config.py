"""`quantization="fp8"`: an "fp8" checkpoint's own weights and block scales, or a float
checkpoint (or dummy weights) quantized to fp8 as it loads (`fp8_loading`).

Layers keep their fp8 bytes with the FP8 method (`linear_methods.FP8_LINEAR`) on any device
but a CPU where the C kernel does not build (`fp8_loading.keep_fp8_on_cpu`); there the fp8
values are dequantized once to the model's dtype and the layers stay dense.
"""

from __future__ import annotations

from torch import nn

from tokenwise.layers.quantization import fp8_loading
from tokenwise.layers.quantization.base_config import QuantizationConfig
from tokenwise.quantization_config import checkpoint_quantization_config, fp8_checkpoint_config


class FP8Config(QuantizationConfig):
    name = "fp8"

    reader: fp8_loading.FP8Checkpoint | None  # None: quantized on load

    def make_reader(self, model: nn.Module) -> fp8_loading.FP8Checkpoint | None:
        qc = checkpoint_quantization_config(self.model_config.hf_config)
        if qc is None:  # a float checkpoint: quantized after loading
            return None
        # fp8 weights and their block scales become dense weights, the fp8 kept aside.
        return fp8_loading.FP8Checkpoint(
            model, fp8_checkpoint_config(qc), fp8_loading.keeps_fp8(self.device)
        )

    def process_model(self, model: nn.Module) -> None:
        if self.reader is not None:
            fp8_loading.install(model, self.reader.record_for, keep_fp8=self.reader.keep)
        else:
            fp8_loading.quantize_on_load(model, keep_fp8=fp8_loading.keeps_fp8(self.device))
