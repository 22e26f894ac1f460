"""The `quantization` setting (vLLM's name): which methods exist, and the one a model gets.

Decided when the model's config is read, before any layer exists, so it lives below the layers;
each name's `QuantizationConfig` (`tokenwise.layers.quantization.registry`) says what the method
does to the layers. A checkpoint
whose config.json carries a `quantization_config` gets its `quant_method` (GPTQ, AWQ,
compressed-tensors); `quantization=` may name it too, and a different name is an error naming
both. GPTQ's and AWQ's settings are checked here (`int_checkpoint_config`), so a checkpoint
tokenwise cannot read fails when it is opened, naming the field, not halfway through loading.
FP8 (`fp8`): a checkpoint whose `quant_method` is "fp8" (block-scaled, as DeepSeek-V3 and
Qwen3-FP8 ship), checked by `fp8_checkpoint_config`, or a float checkpoint quantized on load.
MXFP4 (`mxfp4`): gpt-oss's experts as published (`*_blocks` + `*_scales`), read by the
model's experts method (`layers.quantization.mxfp4`); only from such a checkpoint.
Formats not built yet (bitsandbytes) are refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Quantized on load of a float checkpoint (the name is historical: CPU kernels, and on a CUDA
# GPU tinygemm / per-call dequantization, `keeps_integers`).
CPU_METHODS = ("int8", "int4")
# Checkpoints stored quantized, loaded by `tokenwise.layers.quantization.prequantized`.
PREQUANTIZED = ("gptq", "awq", "compressed-tensors")
# FP8 weights: from an "fp8" checkpoint, or quantized on load; on any device.
FP8 = "fp8"
# gpt-oss's MXFP4 experts, read by the model itself (`layers.quantization.mxfp4`).
MXFP4 = "mxfp4"
METHODS = (*CPU_METHODS, "gguf", *PREQUANTIZED, FP8, MXFP4)
# vLLM's names for GPU kernels of these formats: the same checkpoints.
ALIASES = {"gptq_marlin": "gptq", "awq_marlin": "awq"}
# vLLM's names of formats tokenwise does not load yet (a checkpoint's quant_method included).
NOT_BUILT = ("bitsandbytes",)
GPTQ_FORMATS = ("gptq", "gptq_v2")


@dataclass(frozen=True)
class IntCheckpointConfig:
    """A GPTQ or AWQ checkpoint's settings, as the loader needs them."""

    method: str  # "gptq" or "awq"
    bits: int
    group_size: int  # -1: one group per row (GPTQ)
    # GPTQ's original format ("gptq", v1) stores each zero point minus one; "gptq_v2" does not.
    zeros_minus_one: bool


@dataclass(frozen=True)
class FP8CheckpointConfig:
    """An "fp8" checkpoint's settings (HF transformers' fine-grained FP8 config)."""

    block: tuple[int, int] | None  # weight_block_size; None: one scale per tensor
    static_activations: bool  # activation_scheme "static": layers carry input scales
    modules_to_not_convert: tuple[str, ...]


def fp8_checkpoint_config(qc: dict[str, Any]) -> FP8CheckpointConfig:
    """Check an "fp8" `quantization_config`; errors name the field."""
    where = "fp8 quantization_config"
    fmt = str(qc.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise ValueError(
            f"{where}: fmt={fmt!r} is not supported; tokenwise reads e4m3 (float8_e4m3fn) weights"
        )
    scheme = str(qc.get("activation_scheme", "dynamic")).lower()
    if scheme not in ("dynamic", "static"):
        raise ValueError(
            f"{where}: activation_scheme must be 'dynamic' or 'static', got {scheme!r}"
        )
    block = qc.get("weight_block_size")
    if block is not None:
        ok = isinstance(block, (list, tuple)) and len(block) == 2
        if not ok or not all(
            isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block
        ):
            raise ValueError(
                f"{where}: weight_block_size must be two positive integers [rows, columns] (or "
                f"null for per-tensor scales), got {block!r}"
            )
        block = (int(block[0]), int(block[1]))
    skip = qc.get("modules_to_not_convert") or ()
    if isinstance(skip, str) or not all(isinstance(m, str) for m in skip):
        raise ValueError(f"{where}: modules_to_not_convert must be a list of names, got {skip!r}")
    return FP8CheckpointConfig(block, scheme == "static", tuple(skip))


def _field(qc: dict[str, Any], *names: str, default: Any = None) -> Any:
    for name in names:
        if name in qc:
            return qc[name]
    return default


def int_checkpoint_config(method: str, qc: dict[str, Any]) -> IntCheckpointConfig:
    """Check a GPTQ / AWQ `quantization_config`; errors name the field."""
    where = f"{method} quantization_config"
    bits = _field(qc, "bits", "w_bit")
    allowed = (4, 8) if method == "gptq" else (4,)
    if bits not in allowed:
        raise ValueError(f"{where}: bits={bits!r} is not supported; tokenwise reads {allowed}")
    group_size = _field(qc, "group_size", "q_group_size", default=-1 if method == "gptq" else 128)
    if not isinstance(group_size, int) or not (group_size > 0 or group_size == -1):
        raise ValueError(
            f"{where}: group_size must be a positive integer or -1, got {group_size!r}"
        )
    zeros_minus_one = False
    if method == "gptq":
        fmt = _field(qc, "checkpoint_format", "format", default="gptq") or "gptq"
        if fmt not in GPTQ_FORMATS:
            raise ValueError(
                f"{where}: checkpoint_format={fmt!r} is not supported; tokenwise reads "
                f"{GPTQ_FORMATS}"
            )
        if qc.get("dynamic"):
            raise ValueError(f"{where}: per-module overrides (dynamic) are not supported")
        zeros_minus_one = fmt == "gptq"
    else:
        version = str(_field(qc, "version", default="gemm")).lower()
        if version != "gemm":
            raise ValueError(
                f"{where}: version={version!r} is not supported; tokenwise reads AWQ's GEMM layout"
            )
        if _field(qc, "zero_point", default=True) is not True:
            raise ValueError(f"{where}: zero_point must be true (AWQ without zero points)")
    return IntCheckpointConfig(method, bits, group_size, zeros_minus_one)


def checkpoint_method(hf_config: Any) -> str | None:
    """The checkpoint's `quantization_config.quant_method`, or None for a float checkpoint."""
    qc = checkpoint_quantization_config(hf_config)
    if qc is None:
        return None
    method = qc.get("quant_method")
    return str(getattr(method, "value", method) or "unknown").lower()


def checkpoint_quantization_config(hf_config: Any) -> dict[str, Any] | None:
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None or isinstance(qc, dict):
        return qc
    return qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))


def resolve_quantization(
    quantization: str | None, hf_config: Any, load_format: str, device: str
) -> str | None:
    """The method a model is loaded with, or None for a dense model; errors name the field."""
    if quantization is not None and not isinstance(quantization, str):
        raise ValueError(f"quantization must be a string or None, got {quantization!r}")
    method = quantization.lower() if quantization else None
    method = ALIASES.get(method, method) if method else None
    in_checkpoint = checkpoint_method(hf_config)
    if in_checkpoint is not None:
        in_checkpoint = ALIASES.get(in_checkpoint, in_checkpoint)
        if in_checkpoint not in (*PREQUANTIZED, FP8, MXFP4):
            raise ValueError(
                f"this checkpoint is quantized with quant_method={in_checkpoint!r} (its "
                f"config.json's quantization_config), which tokenwise does not load yet; "
                f"supported: {(*PREQUANTIZED, FP8, MXFP4)}, and quantization in "
                f"{(*CPU_METHODS, FP8)} over float checkpoints and GGUF files"
            )
        if method is not None and method != in_checkpoint:
            raise ValueError(
                f"quantization={quantization!r} does not match the checkpoint's "
                f"quant_method={in_checkpoint!r} (config.json's quantization_config)"
            )
        if in_checkpoint == MXFP4:
            _check_mxfp4(hf_config)
        elif in_checkpoint == FP8:
            fp8_checkpoint_config(checkpoint_quantization_config(hf_config) or {})
        elif in_checkpoint != "compressed-tensors":
            int_checkpoint_config(in_checkpoint, checkpoint_quantization_config(hf_config) or {})
        return in_checkpoint
    if method in NOT_BUILT:
        raise ValueError(f"quantization={quantization!r} is not built yet; supported: {METHODS}")
    if method is not None and method not in METHODS:
        raise ValueError(f"quantization must be one of {METHODS} (or None), got {quantization!r}")
    if method == MXFP4:
        raise ValueError(
            "quantization='mxfp4' needs an MXFP4 checkpoint (gpt-oss as published, "
            "quant_method 'mxfp4' in config.json); tokenwise does not quantize to MXFP4 on load"
        )
    if method in PREQUANTIZED:
        raise ValueError(
            f"quantization={quantization!r} needs a checkpoint quantized with it (config.json's "
            "quantization_config names its quant_method); this one has none"
        )
    if method == "gguf" and load_format != "gguf":
        raise ValueError("quantization='gguf' needs a .gguf model file")
    if method == FP8 and load_format == "gguf":
        raise ValueError(
            "quantization='fp8' quantizes a safetensors checkpoint; a .gguf file has its own"
        )
    if method is None and load_format == "gguf":
        method = "gguf"
    if method in CPU_METHODS and not keeps_integers(method, device):
        raise ValueError(
            f"quantization={method!r} runs on CPU and CUDA devices only; on {device!r} load "
            "the model unquantized (quantization=None)"
        )
    return method


def _check_mxfp4(hf_config: Any) -> None:
    """MXFP4 checkpoints exist for gpt-oss's experts only; other families are refused here."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    if "GptOssForCausalLM" not in archs:
        raise ValueError(
            f"quant_method='mxfp4' is supported for gpt-oss (GptOssForCausalLM) experts only; "
            f"this checkpoint's architectures are {archs}"
        )


def uses_cpu_kernels(method: str | None, device: str) -> bool:
    """Whether a model loaded with `method` on `device` runs the quantized CPU kernels (eager
    only: torch.compile does not trace them)."""
    return method in (*CPU_METHODS, "gguf", *PREQUANTIZED) and device.startswith("cpu")


def keeps_integers(method: str | None, device: str) -> bool:
    """Whether a model loaded with `method` on `device` keeps its layers' integers (int8 / int4
    memory): on the CPU (its kernels) and on CUDA GPUs (`layers.quantization.gpu_selfcheck`:
    torch's int4 kernel where it proved right at load, else per-call dequantization). Other
    devices get GGUF and quantized checkpoints dequantized to the model's dtype on load."""
    on_device = device.startswith("cpu") or device.startswith("cuda")
    return on_device and method in (*CPU_METHODS, "gguf", *PREQUANTIZED)
