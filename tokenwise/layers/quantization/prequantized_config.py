"""The configs of checkpoints stored quantized: GPTQ, AWQ and compressed-tensors.

Each one's reader (`prequantized.PrequantizedCheckpoint`, built over its format's converter)
wraps the checkpoint's tensors while they load; after loading, each layer whose parts were all
recorded alike gets the checkpoint's own integers and the weight-only method, and
compressed-tensors' FP8 layers their fp8 bytes and the FP8 method.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any, ClassVar

from torch import nn

from tokenwise.layers.quantization import awq, compressed_tensors, fp8_loading, gptq
from tokenwise.layers.quantization.prequantized import PrequantizedCheckpoint
from tokenwise.layers.quantization.schemes import quantize_model
from tokenwise.layers.quantization.weight_only_config import IntegerConfig
from tokenwise.quantization_config import checkpoint_quantization_config, int_checkpoint_config


class PrequantizedConfig(IntegerConfig):
    """A checkpoint whose `quantization_config` names this method."""

    # Quantized layers' tensors are read whole; under TP each rank then keeps its slice of
    # their integers (`tp_slice`). None until a checkpoint was wrapped (and for dummy weights).
    reader: PrequantizedCheckpoint | None

    @property
    def checkpoint_config(self) -> dict[str, Any]:
        return checkpoint_quantization_config(self.model_config.hf_config) or {}

    def process_model(self, model: nn.Module) -> None:
        reader = self.reader
        if self.keep_ints and reader is not None:
            quantize_model(model, reader.scheme_for, reader.exact)
        self.finish(model)
        if reader is not None and reader.fp8_records:  # compressed-tensors FP8 layers
            fp8_loading.install(model, reader.fp8_record_for, keep_fp8=True)


class _IntCheckpointConfig(PrequantizedConfig):
    """GPTQ and AWQ: the format module's converter, over the checked config."""

    fmt: ClassVar[ModuleType]

    def make_reader(self, model: nn.Module) -> PrequantizedCheckpoint:
        fmt = self.fmt
        config = int_checkpoint_config(self.name, self.checkpoint_config)
        convert = functools.partial(fmt.convert, config)
        return PrequantizedCheckpoint(model, fmt.SUFFIXES, fmt.MARKER, convert, self.keep_ints)


class GPTQConfig(_IntCheckpointConfig):
    name = "gptq"
    fmt = gptq


class AWQConfig(_IntCheckpointConfig):
    name = "awq"
    fmt = awq


class CompressedTensorsConfig(PrequantizedConfig):
    name = "compressed-tensors"

    def make_reader(self, model: nn.Module) -> PrequantizedCheckpoint:
        return compressed_tensors.reader(
            model, self.checkpoint_config, self.keep_ints, fp8_loading.keeps_fp8(self.device)
        )
