"""The one registry of quantization methods: `quantization` name -> its `QuantizationConfig`.

The loader looks a model's method up here (`get_quantization_config`) and never branches on
its name. Entries are "module:Class" strings, imported on first use, so the registry imports
none of the formats' readers (a method's optional dependency, compressed-tensors, is imported
only by a model that uses it) and a format module may import anything below it.

Adding a method is one line in `QUANTIZATION_METHODS` (or one `register_quantization_config`
call, for code outside tokenwise), plus its name in `tokenwise.quantization_config`, which
decides, before any layer exists, which name a model gets.
"""

from __future__ import annotations

import importlib

from tokenwise.layers.quantization.base_config import QuantizationConfig

UNQUANTIZED = "none"  # the entry of `quantization=None`

_PACKAGE = "tokenwise.layers.quantization"
QUANTIZATION_METHODS: dict[str, str | type[QuantizationConfig]] = {
    UNQUANTIZED: f"{_PACKAGE}.unquantized:UnquantizedConfig",
    "int8": f"{_PACKAGE}.weight_only_config:Int8Config",
    "int4": f"{_PACKAGE}.weight_only_config:Int4Config",
    "gguf": f"{_PACKAGE}.gguf_layers:GGUFConfig",
    "gptq": f"{_PACKAGE}.prequantized_config:GPTQConfig",
    "awq": f"{_PACKAGE}.prequantized_config:AWQConfig",
    "compressed-tensors": f"{_PACKAGE}.prequantized_config:CompressedTensorsConfig",
    "fp8": f"{_PACKAGE}.fp8_config:FP8Config",
    "mxfp4": f"{_PACKAGE}.mxfp4:Mxfp4Config",
}


def register_quantization_config(name: str, config: str | type[QuantizationConfig]) -> None:
    """Make `quantization=name` load with `config` (a class, or "module:Class")."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a quantization method's name must be a non-empty string, got {name!r}")
    QUANTIZATION_METHODS[name] = config


def get_quantization_config(name: str | None) -> type[QuantizationConfig]:
    """The config class of method `name` (None: unquantized)."""
    key = UNQUANTIZED if name is None else name
    entry = QUANTIZATION_METHODS.get(key)
    if entry is None:
        raise ValueError(
            f"quantization={name!r} has no registered method; registered: "
            f"{sorted(k for k in QUANTIZATION_METHODS if k != UNQUANTIZED)}"
        )
    if isinstance(entry, str):
        module, _, cls_name = entry.partition(":")
        entry = getattr(importlib.import_module(module), cls_name)
        QUANTIZATION_METHODS[key] = entry
    if not (isinstance(entry, type) and issubclass(entry, QuantizationConfig)):
        raise TypeError(f"quantization method {key!r} is registered as {entry!r}, not a config")
    return entry
