"""The `quantization` setting (vLLM's name): which methods exist, and the one a model gets.

Decided when the model's config is read, before any layer exists, so it lives below the layers;
`tokenwise.layers.quantization.schemes` says what each method does to the layers. Checkpoints
that carry a `quantization_config` (GPTQ, AWQ, compressed-tensors, FP8) are refused by name
until their loaders exist, rather than failing later on unknown tensor names.
"""

from __future__ import annotations

from typing import Any

CPU_METHODS = ("int8", "int4")
METHODS = (*CPU_METHODS, "gguf")
# vLLM's names of formats tokenwise does not load yet (a checkpoint's quant_method included).
NOT_BUILT = (
    "gptq",
    "awq",
    "compressed-tensors",
    "fp8",
    "bitsandbytes",
    "gptq_marlin",
    "awq_marlin",
)


def _checkpoint_method(hf_config: Any) -> str | None:
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    return str(getattr(method, "value", method) or "unknown")


def resolve_quantization(
    quantization: str | None, hf_config: Any, load_format: str, device: str
) -> str | None:
    """The method a model is loaded with, or None for a dense model; errors name the field."""
    if quantization is not None and not isinstance(quantization, str):
        raise ValueError(f"quantization must be a string or None, got {quantization!r}")
    method = quantization.lower() if quantization else None
    in_checkpoint = _checkpoint_method(hf_config)
    if in_checkpoint is not None:
        raise ValueError(
            f"this checkpoint is quantized with quant_method={in_checkpoint!r} (its "
            f"config.json's quantization_config), which tokenwise does not load yet; "
            f"supported: quantization in {METHODS} over float checkpoints and GGUF files"
        )
    if method in NOT_BUILT:
        raise ValueError(f"quantization={quantization!r} is not built yet; supported: {METHODS}")
    if method is not None and method not in METHODS:
        raise ValueError(f"quantization must be one of {METHODS} (or None), got {quantization!r}")
    if method == "gguf" and load_format != "gguf":
        raise ValueError("quantization='gguf' needs a .gguf model file")
    if method is None and load_format == "gguf":
        method = "gguf"
    if method in CPU_METHODS and not device.startswith("cpu"):
        raise ValueError(
            f"quantization={method!r} has CPU kernels only; on {device!r} load the model "
            "unquantized (quantization=None)"
        )
    return method


def uses_cpu_kernels(method: str | None, device: str) -> bool:
    """Whether a model loaded with `method` on `device` runs the quantized CPU kernels."""
    return method in CPU_METHODS or (method == "gguf" and device.startswith("cpu"))
