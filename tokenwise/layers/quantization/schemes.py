"""Which quantization a model gets (`quantization=` / `--quantization`, vLLM's name) and which
format each of its linear layers ends up in.

Methods built:
- `int8`, `int4`: weight-only round-to-nearest on load, per group of 32 input values, of a
  float checkpoint (int8 symmetric, int4 asymmetric); CPU only (the kernels are CPU kernels).
- `gguf` (automatic for a `.gguf` file): a linear layer whose file tensors are Q8_0, Q4_0 or
  Q4_1 keeps that format (int8 symmetric, int4 symmetric, int4 with offsets), quantized from
  the file's float32 values, which gives back exactly the file's integers and float16 scales
  (the largest and smallest values of a block set its scale in both quantizers). Other types
  (the K-quants, Q5_*, IQ*) are dequantized to the model's dtype for now: their scales are
  products (`d * sc`) that float16 does not hold, so re-quantizing them would move the weights.
  On a GPU every GGUF weight is dequantized to the model's dtype.
- `gptq`, `awq`, `compressed-tensors` (from the checkpoint's `quantization_config`): each layer
  keeps the checkpoint's own integers and scales (`prequantized`, with `gptq`, `awq` and
  `compressed_tensors` reading the formats); FP8 and what the kernels cannot take stay dense.
Which method a model gets is decided in `tokenwise.quantization_config` (below the layers).

Layers: every linear layer (`ReplicatedLinear` and its parallel kinds) and the LM head. The
token embedding stays dense (a lookup reads a few rows, not the matrix). Under tensor
parallelism each rank quantizes the slice it holds. A layer whose input size is not a multiple
of the group size stays dense (int8 drops to groups of 16 first), with a log line naming it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from tokenwise.layers.quantization.weight_only import QuantizedWeight, quantize

logger = logging.getLogger(__name__)

GROUP_SIZE = 32


@dataclass(frozen=True)
class Scheme:
    """How one layer is quantized."""

    bits: int
    symmetric: bool
    group_size: int = GROUP_SIZE

    @property
    def precision(self) -> int:
        """Higher is closer to the dense weight (to pick one scheme for a fused layer)."""
        return self.bits * 2 + (0 if self.symmetric else 1)


INT8 = Scheme(8, True)
INT4 = Scheme(4, False)
# GGUF tensor types and the scheme that holds their values (None: kept dense).
GGUF_SCHEMES: dict[str, Scheme | None] = {
    "F32": None,
    "F16": None,
    "BF16": None,
    "Q8_0": INT8,
    "Q4_0": Scheme(4, True),
    "Q4_1": INT4,
    # K-quants: exact with float32 scales (gguf_kquants); re-quantized from the dense weight
    # under tensor parallelism.
    "Q4_K": INT4,
    "Q5_K": INT8,
    "Q6_K": Scheme(8, True, 16),
}


def quantizable_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every linear layer the methods quantize: the modules that can hold a
    `packed_weight` with a 2-D weight (the linear layers and the LM head)."""
    return [
        (name, module)
        for name, module in model.named_modules()
        if hasattr(module, "packed_weight")
        and isinstance(getattr(module, "weight", None), torch.Tensor)
        and module.weight.dim() == 2
    ]


def quantize_model(
    model: nn.Module,
    scheme_for: Callable[[str, nn.Module], Scheme | None],
    exact: Callable[[str, nn.Module, Scheme], QuantizedWeight | None] | None = None,
) -> int:
    """Quantize every layer `scheme_for(name, module)` gives a scheme; returns how many.

    `exact(name, module, scheme)` may supply the layer's quantized weight ready-made (GGUF: the
    file's own integers); otherwise it is quantized from the loaded dense weight. The dense
    weight is then dropped (kept on the "meta" device, so its shape and dtype still answer),
    except where another module shares it (a tied LM head's embedding).
    """
    shared = _shared_weights(model)
    count = 0
    dense_bytes = quant_bytes = 0
    for name, module in quantizable_layers(model):
        scheme = scheme_for(name, module)
        if scheme is None:
            continue
        weight = module.weight
        group = _group_size(scheme, weight.shape[1])
        if group is None:
            logger.info(
                "%s stays dense: its input size %d is not a multiple of int%d's group size %d",
                name,
                weight.shape[1],
                scheme.bits,
                scheme.group_size,
            )
            continue
        if group != scheme.group_size:
            scheme = Scheme(scheme.bits, scheme.symmetric, group)
        packed = exact(name, module, scheme) if exact is not None else None
        if packed is None:
            packed = quantize(weight, scheme.bits, scheme.group_size, scheme.symmetric)
        module.packed_weight = packed
        dense_bytes += weight.numel() * weight.element_size()
        quant_bytes += packed.nbytes
        if id(weight) not in shared:
            meta = torch.empty(weight.shape, dtype=weight.dtype, device="meta")
            module.weight = nn.Parameter(meta, requires_grad=False)
        count += 1
    if count:
        logger.info(
            "quantized %d linear layers: %.1f MiB of weights instead of %.1f MiB",
            count,
            quant_bytes / 2**20,
            dense_bytes / 2**20,
        )
    return count


def _group_size(scheme: Scheme, in_features: int) -> int | None:
    """The scheme's group size, or for int8 16 where that divides the input size and 32 does
    not; None when the layer cannot be quantized."""
    if in_features % scheme.group_size == 0:
        return scheme.group_size
    if scheme.bits == 8 and in_features % 16 == 0:
        return 16
    return None


def _shared_weights(model: nn.Module) -> set[int]:
    """ids of weights held by more than one module (tied embeddings and LM heads)."""
    owners: dict[int, int] = {}
    for module in model.modules():
        weight = module._parameters.get("weight") if hasattr(module, "_parameters") else None
        if weight is not None:
            owners[id(weight)] = owners.get(id(weight), 0) + 1
    return {key for key, n in owners.items() if n > 1}
