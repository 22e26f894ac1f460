"""Which quantization a model gets (`quantization=` / `--quantization`, vLLM's name) and which
format each of its linear layers ends up in.

Methods built:
- `int8`, `int4`: weight-only round-to-nearest on load of a float checkpoint: int8 symmetric
  in groups of 32 (Q8_0), int4 with offsets in groups of 64; CPU (its kernels) and CUDA
  (`gpu_selfcheck`: torch's int4 kernel or per-call dequantization).
- `gguf` (automatic for a `.gguf` file): a linear layer whose file tensors are Q8_0, Q4_0 or
  Q4_1 keeps that format (int8 symmetric, int4 symmetric, int4 with offsets), quantized from
  the file's float32 values, which gives back exactly the file's integers and float16 scales
  (the largest and smallest values of a block set its scale in both quantizers). Other types
  (the K-quants, Q5_*, IQ*) are dequantized to the model's dtype for now: their scales are
  products (`d * sc`) that float16 does not hold, so re-quantizing them would move the weights.
  On a CUDA GPU the same formats are kept (other GPUs: every weight dequantized).
- `gptq`, `awq`, `compressed-tensors` (from the checkpoint's `quantization_config`): each layer
  keeps the checkpoint's own integers and scales (`prequantized`, with `gptq`, `awq` and
  `compressed_tensors` reading the formats); what the kernels cannot take stays dense.
- `fp8` (an "fp8" checkpoint, or on load), and compressed-tensors FP8 layers: `FP8Weight`s,
  installed by `fp8_loading`, not by the schemes here.
Which method a model gets is decided in `tokenwise.quantization_config` (below the layers).

Layers: every linear layer (`ReplicatedLinear` and its parallel kinds), the LM head, the token
embedding (rows dequantized as they are looked up; a tied embedding and head share one table)
and, with `int8` / `int4` on the CPU, each routed expert of an MoE layer (`quantize_experts`). Under tensor
parallelism each rank quantizes the slice it holds (`int8` / `int4`), or takes its slice of the
checkpoint's integers (`tp_slice`). A layer whose input size is not a multiple
of the group size takes the largest smaller group that fits (32, then 16 for int8), else stays
dense with a log line naming it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tokenwise.layers.quantization.base_config import is_linear
from tokenwise.layers.quantization.linear_methods import WEIGHT_ONLY, use_quantized_weight
from tokenwise.layers.quantization.weight_only import QuantizedExperts, group_multiple, quantize
from tokenwise.platform import release_freed_memory

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
# int4 with offsets in groups of 64: 36 bytes per 64 weights (28% of bf16), as close to the
# dense weights as symmetric groups of 32 (Q4_0's 18 bytes per 32), and half the per-group work.
INT4 = Scheme(4, False, 64)
# GGUF tensor types and the scheme that holds their values (None: kept dense).
GGUF_SCHEMES: dict[str, Scheme | None] = {
    "F32": None,
    "F16": None,
    "BF16": None,
    "Q8_0": INT8,
    "Q4_0": Scheme(4, True),
    "Q4_1": INT4,
    # K-quants: exact with float32 scales (gguf_kquants), under tensor parallelism too.
    "Q4_K": INT4,
    "Q5_K": INT8,
    "Q6_K": Scheme(8, True, 16),
}


# MoE routers stay dense: tiny layers whose logits pick the experts (a rounding there changes
# which experts run, not just their output).
ROUTERS = ("gate", "shared_expert_gate")


def on_load_scheme(scheme: Scheme) -> Callable[[str, nn.Module], Scheme | None]:
    """`scheme_for` of the int8 / int4 methods: every layer but the MoE routers."""
    return lambda name, module: None if name.rpartition(".")[2] in ROUTERS else scheme


def quantizable_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every layer the methods quantize: the linear layers (modules with a
    linear `quant_method`, the LM head included) and the modules that can hold a `quant_table`
    (the token embedding), with a 2-D weight."""
    return [
        (name, module)
        for name, module in model.named_modules()
        if (is_linear(module) or hasattr(module, "quant_table"))
        and not getattr(module, "quant_exempt", False)  # a layer whose weight is read as such
        and isinstance(getattr(module, "weight", None), torch.Tensor)
        and module.weight.dim() == 2
    ]


def quantize_model(
    model: nn.Module,
    scheme_for: Callable[[str, nn.Module], Scheme | None],
    exact: Callable[[str, nn.Module, Scheme], Any] | None = None,
) -> int:
    """Quantize every layer `scheme_for(name, module)` gives a scheme; returns how many.

    `exact(name, module, scheme)` may supply the layer's quantized weight ready-made (GGUF: the
    file's own integers); otherwise it is quantized from the loaded dense weight. A weight two
    modules share (a tied embedding and LM head) is quantized once and used by both. The dense
    weight is then dropped (kept on the "meta" device, so its shape and dtype still answer)
    unless a module holding it stays dense.
    """
    holders: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        weight = module._parameters.get("weight")
        if weight is not None:
            holders.setdefault(id(weight), []).append(module)
    done: dict[int, tuple[Scheme, Any]] = {}
    count = dense_bytes = quant_bytes = 0
    for name, module in quantizable_layers(model):
        scheme = scheme_for(name, module)
        weight = module.weight
        group = None if scheme is None else _group_size(scheme, weight.shape[1])
        if scheme is None or group is None:
            if scheme is not None:
                logger.info(
                    "%s stays dense: its input size %d is not a multiple of int%d's group "
                    "size %d", name, weight.shape[1], scheme.bits, scheme.group_size,
                )  # fmt: skip
            continue
        if group != scheme.group_size:
            scheme = Scheme(scheme.bits, scheme.symmetric, group)
        previous = done.get(id(weight))
        if previous is not None and previous[0] == scheme:
            packed = previous[1]
        else:
            packed = exact(name, module, scheme) if exact is not None else None
            if packed is None:
                packed = quantize(weight, scheme.bits, scheme.group_size, scheme.symmetric)
            done[id(weight)] = (scheme, packed)
            dense_bytes += weight.numel() * weight.element_size()
            quant_bytes += packed.nbytes
        if hasattr(module, "quant_table"):
            module.quant_table = packed
        else:
            use_quantized_weight(module, WEIGHT_ONLY, packed)
        count += 1
    for key, modules in holders.items():
        if key in done and all(_is_quantized(m) for m in modules):
            weight = modules[0].weight
            meta = nn.Parameter(
                torch.empty(weight.shape, dtype=weight.dtype, device="meta"), requires_grad=False
            )
            for module in modules:
                module.weight = meta
    if count:
        release_freed_memory()
        logger.info(
            "quantized %d layers: %.1f MiB of weights instead of %.1f MiB",
            count,
            quant_bytes / 2**20,
            dense_bytes / 2**20,
        )
    return count


def quantize_experts(model: nn.Module, scheme: Scheme) -> int:
    """Quantize the routed experts of every MoE layer (modules with `quant_experts`), each
    expert's two weights on their own, and hand them to the layer (`use_quantized_experts`,
    which switches its method); returns how many layers. Layers whose hidden or
    intermediate size fits no group stay dense."""
    count = 0
    for name, module in model.named_modules():
        if not hasattr(module, "quant_experts"):
            continue
        w13, w2 = module.w13_weight, module.w2_weight
        g13, g2 = _group_size(scheme, w13.shape[2]), _group_size(scheme, w2.shape[2])
        if g13 is None or g2 is None:
            logger.info("%s's experts stay dense: no int%d group fits them", name, scheme.bits)
            continue
        module.use_quantized_experts(
            QuantizedExperts(
                [quantize(w, scheme.bits, g13, scheme.symmetric) for w in w13],
                [quantize(w, scheme.bits, g2, scheme.symmetric) for w in w2],
            )
        )
        count += 1
    if count:
        release_freed_memory()
    return count


def _is_quantized(module: nn.Module) -> bool:
    held = getattr(module, "quant_table", None) or getattr(module, "quant_weight", None)
    return held is not None


def _group_size(scheme: Scheme, in_features: int) -> int | None:
    """The scheme's group size, or the largest smaller one the kernels take (32, then 16 for
    int8) that divides the input size; None when the layer cannot be quantized."""
    smaller = [g for g in (32, 16) if g < scheme.group_size and g >= group_multiple(scheme.bits)]
    for group in (scheme.group_size, *smaller):
        if in_features % group == 0:
            return group
    return None
