"""compressed-tensors checkpoints (llm-compressor's output): each quantized linear layer's
tensors as a dense weight and, for integer weights, an exact `QuantizedWeight` (see
`prequantized` for how the loader uses both). Read with the `compressed-tensors` package: its
config model parses `quantization_config`, its own unpacker reads `pack-quantized` words and its
compressors dequantize FP8, so the layout is the package's, not a copy of it.

Formats (`quantization_config.format`, or a config group's own `format`):
- `pack-quantized` (W4A16 and W8A16): `weight_packed` int32 holding the signed integers, packed
  along K; `weight_scale` `[N, K / G]` (group) or `[N, 1]` (channel); `weight_zero_point`
  (asymmetric only, packed along N); `weight_shape`; `weight_g_idx` with act-order groups.
- `int-quantized` / `naive-quantized` with int8 weights (W8A8): `weight` int8, `weight_scale`
  per channel or per tensor, `weight_zero_point` when asymmetric. tokenwise runs these
  weight-only on CPU: the weights keep their integers, activations stay in floating point
  (the checkpoint's `input_scale` and dynamic per-token activation quantization are not
  applied), so logits differ from a W8A8 kernel's by the activations' rounding, which is
  what weight-only avoids.
- `float-quantized` (FP8 W8A8): `weight` float8_e4m3fn with its scales (tensor, channel or
  block strategy): kept as an `FP8Weight` (`fp8`: W8A8 on CUDA, the `native.fp8_gemv` kernel on CPU)
  where the loader keeps FP8 layers, else dequantized to the model's dtype on load.
`w = (q - z) * s` per group for the integer formats, as in `prequantized`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from tokenwise.layers.quantization.fp8 import FP8_DTYPE, FP8Weight
from tokenwise.layers.quantization.prequantized import (
    Converted,
    PrequantizedCheckpoint,
    group_dense,
    integer_weight,
)

logger = logging.getLogger(__name__)

SUFFIXES = (
    "weight",
    "weight_packed",
    "weight_scale",
    "weight_zero_point",
    "weight_shape",
    "weight_g_idx",
    "input_scale",
    "input_zero_point",
    "output_scale",
    "output_zero_point",
)
MARKER = "weight_scale"
# Static activation quantization parameters: read and ignored (activations stay float).
DROPPED = ("input_scale", "input_zero_point", "output_scale", "output_zero_point")
FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")


def reader(
    model: nn.Module, qc: dict[str, Any], keep_exact: bool, keep_fp8: bool = False
) -> PrequantizedCheckpoint:
    """The reader of a compressed-tensors checkpoint; its config checked (errors name fields)."""
    from compressed_tensors.quantization import QuantizationConfig

    try:
        config = QuantizationConfig.model_validate(qc)
    except Exception as e:  # pydantic's ValidationError names the field
        raise ValueError(f"compressed-tensors quantization_config is not valid: {e}") from e
    if config.kv_cache_scheme is not None:
        raise ValueError(
            "compressed-tensors quantization_config: kv_cache_scheme (a quantized KV cache) "
            "is not supported"
        )
    schemes = []
    for group_name, scheme in config.config_groups.items():
        if isinstance(scheme, list):
            raise ValueError(f"compressed-tensors config_groups.{group_name}: not a scheme")
        _check_scheme(group_name, scheme, scheme.format or config.format)
        schemes.append(scheme)

    def convert(name: str, parts: dict[str, torch.Tensor]) -> Converted:
        return _convert(name, parts, _scheme_for(name, schemes).weights)

    return PrequantizedCheckpoint(
        model, SUFFIXES, MARKER, convert, keep_exact, DROPPED, keep_fp8=keep_fp8
    )


def _check_scheme(group: str, scheme: Any, fmt: str) -> None:
    where = f"compressed-tensors config_groups.{group}"
    if fmt not in FORMATS:
        raise ValueError(f"{where}: format={fmt!r} is not supported; tokenwise reads {FORMATS}")
    args = scheme.weights
    if args is None:
        raise ValueError(f"{where}: weights is missing (activation-only schemes are not supported)")
    kind = (str(args.type), args.num_bits)
    if kind not in (("int", 4), ("int", 8), ("float", 8)):
        raise ValueError(
            f"{where}.weights: type={args.type!r} num_bits={args.num_bits} is not supported; "
            "tokenwise reads int 4, int 8 and float 8"
        )
    strategies = ("group", "channel", "tensor") + (("block",) if kind[0] == "float" else ())
    if str(args.strategy) not in strategies:
        raise ValueError(
            f"{where}.weights: strategy={args.strategy!r} is not supported for "
            f"{args.type} weights; tokenwise reads {strategies}"
        )
    if scheme.input_activations is not None:
        logger.info(
            "%s quantizes activations too (%s %d-bit): tokenwise runs it weight-only on CPU, "
            "activations stay in floating point",
            where,
            scheme.input_activations.type,
            scheme.input_activations.num_bits,
        )


def _scheme_for(name: str, schemes: list[Any]) -> Any:
    """The config group whose targets name this layer (a regex or its name), else the one
    targeting every `Linear`; compressed-tensors' own name matching."""
    from compressed_tensors.utils.match import match_name

    for scheme in schemes:
        if any(match_name(name, target) for target in scheme.targets):
            return scheme
    for scheme in schemes:
        if "Linear" in scheme.targets:
            return scheme
    raise ValueError("no config group targets this layer")


def _convert(name: str, parts: dict[str, torch.Tensor], args: Any) -> Converted:
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    scale = parts["weight_scale"]
    if "weight_packed" in parts:
        shape = tuple(int(n) for n in parts["weight_shape"].tolist())
        q = unpack_from_int32(parts["weight_packed"], args.num_bits, torch.Size(shape))
    elif parts["weight"].dtype.is_floating_point:
        return Converted(_float_dense(parts, args), None, _fp8_record(parts, args))
    else:
        q = parts["weight"]
    n, k = q.shape
    if scale.numel() == 1:  # one scale for the tensor: one group per row
        scale = scale.reshape(1, 1).expand(n, 1)
    if scale.dim() != 2 or scale.shape[0] != n or k % scale.shape[1]:
        raise ValueError(f"weight_scale {tuple(scale.shape)} does not fit a [{n}, {k}] weight")
    zeros = parts.get("weight_zero_point")
    if zeros is None:
        if not args.symmetric:
            raise ValueError("an asymmetric scheme needs weight_zero_point")
        zeros = torch.zeros(scale.shape, dtype=torch.int32)
    elif "weight_packed" in parts and str(args.strategy) in ("group", "channel"):
        zeros = unpack_from_int32(zeros, args.num_bits, torch.Size(scale.shape), packed_dim=0)
    zeros = zeros.reshape(-1, 1).expand(n, 1) if zeros.numel() == 1 else zeros
    size = k // scale.shape[1]
    g_idx = parts.get("weight_g_idx")
    groups = torch.arange(k) // size if g_idx is None else g_idx.to(torch.int64)
    dense = group_dense(q, zeros, scale, groups)
    record = integer_weight(name, q, zeros, scale, args.num_bits, groups, signed=True)
    return Converted(dense, record)


def _fp8_record(parts: dict[str, torch.Tensor], args: Any) -> FP8Weight | None:
    """The layer's float8_e4m3fn weight and scales as an `FP8Weight`; None (dense) for other
    float formats or scale shapes."""
    weight, scale = parts["weight"], parts["weight_scale"].float()
    if weight.dtype != FP8_DTYPE or weight.dim() != 2:
        return None
    n, k = weight.shape
    block = None
    if str(args.strategy) == "block":
        bn, bk = (int(b) for b in args.block_structure)
        block = (bn, bk)
    elif scale.numel() == 1:
        scale = scale.reshape(1, 1)
    elif scale.numel() == n:
        scale = scale.reshape(n, 1)
    try:
        return FP8Weight(weight.contiguous(), scale.contiguous(), (n, k), block)
    except ValueError:
        return None


def _float_dense(parts: dict[str, torch.Tensor], args: Any) -> torch.Tensor:
    """FP8 weights through the package's own decompressor, in float32."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    compressor = BaseCompressor.get_value_from_registry("float-quantized")
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    state = {"weight": parts["weight"], "weight_scale": parts["weight_scale"].float()}
    return compressor.decompress(state, scheme)["weight"].float()
