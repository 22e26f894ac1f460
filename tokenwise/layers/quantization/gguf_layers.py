"""GGUF linear layers kept quantized: each layer's scheme from its file tensors' types, and its
integers and scales taken from the file's values rather than from the rounded dense weights.

The loader dequantizes every tensor to float32 (`weights.iterate_gguf`) and copies it into the
model in the model's dtype. `GGUFLayerQuantizer.observe` sees the float32 values first and
quantizes each tensor of a quantized type with the scheme that holds it (`GGUF_SCHEMES`): for
Q8_0 and Q4_0 that recovers the file's integers and float16 scales exactly (the largest value of
a block sets its scale in both quantizers, and float32 holds `d * q` exactly). After loading,
`exact` assembles each layer's weight from its parts (q, k, v rows of a fused projection, in
order), and `scheme_for` picks the layer's scheme: the most precise of its parts', dense when
any part is dense (a float tensor, or a type without an exact scheme). A fused layer whose parts
differ in scheme (Q8_0 q with Q4_0 k) is quantized from its dense weight with the most precise.

Routed experts (`quantize_experts`): llama.cpp stacks an MoE layer's experts per projection;
the loader yields them expert by expert (`gguf.weights`), so each expert's gate, up and down
tensors are recorded like any other, and each expert's `w13` is its gate and up records joined
(as q, k, v are), `w2` its down record: a `QuantizedExperts` holding the file's integers, run by
`FusedMoE` one expert at a time as int8 / int4 experts are. An expert of a dense or unrecorded
type leaves the layer's experts dense (as do experts sliced under tensor parallelism).

Under tensor parallelism each rank takes its slice of the records (`tp_slice`: rows of the
column-parallel parts, columns of the row-parallel layers on their groups' boundaries), the
file's integers and scales still, not the loaded dense slice rounded again.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from tokenwise.layers.quantization.base_config import GGUFObserver
from tokenwise.layers.quantization.gguf_kquants import KQUANTS, kquant_weight
from tokenwise.layers.quantization.schemes import GGUF_SCHEMES, Scheme, quantize_model
from tokenwise.layers.quantization.tp_slice import RankSlices
from tokenwise.layers.quantization.weight_only import (
    QuantizedExperts,
    QuantizedParts,
    QuantizedWeight,
    quantize,
    stack_rows,
)
from tokenwise.layers.quantization.weight_only_config import IntegerConfig
from tokenwise.layers.weight_utils import StackedMapping, checkpoint_names


def scheme_of_type(type_name: str) -> Scheme | None:
    """The scheme holding a GGUF tensor type's values exactly; None: kept dense."""
    return GGUF_SCHEMES.get(type_name)


class GGUFLayerQuantizer:
    """Collects the file's tensor types and exact quantized tensors while a GGUF file loads."""

    def __init__(self, model: nn.Module, keep_exact: bool) -> None:
        self.mapping: StackedMapping = getattr(model, "stacked_params_mapping", ())
        self.param_names = {id(p): name for name, p in model.named_parameters()}
        self.keep_exact = keep_exact
        self.types: dict[str, str] = {}
        self.records: dict[str, QuantizedWeight] = {}
        self.slices = RankSlices(model, self.mapping)

    def observe(self, hf_name: str, values: torch.Tensor, type_name: str, raw: np.ndarray) -> None:
        self.types[hf_name] = type_name
        scheme = scheme_of_type(type_name)
        if not self.keep_exact or scheme is None or values.dim() != 2:
            return
        if type_name in KQUANTS:
            record = kquant_weight(values, raw, type_name)
        elif values.shape[1] % scheme.group_size == 0:
            record = quantize(values, scheme.bits, scheme.group_size, scheme.symmetric)
        else:
            return
        mine = self.slices.take(hf_name, record)  # this rank's slice (`tp_slice`)
        if mine is not None:
            mine.gguf_file = True  # float32 activations: int8 by default, as llama.cpp
            self.records[hf_name] = mine

    def quantize_experts(self, model: nn.Module) -> int:
        """Give every MoE layer whose experts are all recorded its file's integers; returns
        how many layers (the dense expert weights then move to the meta device)."""
        count = 0
        for name, per_expert in expert_checkpoint_names(model).items():
            module = model.get_submodule(name)
            records = [[self.records.get(n) for n in names] for names in per_expert]
            if any(r is None for names in records for r in names):
                continue
            w13 = [_joined([gate, up]) for gate, up, _ in records]  # type: ignore[list-item]
            w2 = [down for _, _, down in records]
            if any(w.shape != tuple(module.w13_weight.shape[1:]) for w in w13):
                continue  # sliced (TP) experts: they stay dense
            module.use_quantized_experts(QuantizedExperts(w13, w2))  # type: ignore[arg-type]
            count += 1
        return count

    def _parts(self, module: nn.Module) -> list[str]:
        """The checkpoint names of a layer's weight, in the fused layer's row order."""
        name = self.param_names[id(module.weight)]  # a tied head's weight is the embedding's
        return list(checkpoint_names(name, self.mapping).values())

    def scheme_for(self, name: str, module: nn.Module) -> Scheme | None:
        types = [self.types.get(part) for part in self._parts(module)]
        if any(t is None for t in types):
            return None
        schemes = [scheme_of_type(t) for t in types]  # type: ignore[arg-type]
        if any(s is None for s in schemes):
            return None
        return max(schemes, key=lambda s: s.precision)  # type: ignore[union-attr]

    def exact(
        self, name: str, module: nn.Module, scheme: Scheme
    ) -> QuantizedWeight | QuantizedParts | None:
        parts = [self.records.get(part) for part in self._parts(module)]
        if not parts or any(p is None for p in parts):
            return None  # a dense part, or no exact slice on this rank: quantize the layer
        if (sum(p.shape[0] for p in parts), parts[0].shape[1]) != tuple(module.weight.shape):
            return None  # a padded layer: quantize its own rows
        return _joined(parts)  # type: ignore[arg-type]


def expert_checkpoint_names(model: nn.Module) -> dict[str, list[tuple[str, str, str]]]:
    """`{MoE experts module: [(gate, up, down) checkpoint weight names of each local expert]}`
    (modules with `quant_experts`; names as the model's checkpoints spell them: Mixtral's
    `block_sparse_moe.experts.3.w1.weight`)."""
    proj_names = getattr(model, "expert_proj_names", None)
    if proj_names is None:
        return {}
    back = {v: k for k, v in getattr(model, "checkpoint_renames", {}).items()}
    names: dict[str, list[tuple[str, str, str]]] = {}
    for name, module in model.named_modules():
        if not hasattr(module, "quant_experts"):
            continue
        prefix = ".".join(back.get(part, part) for part in name.split("."))
        first, local = module.shard.first_expert, module.shard.num_local_experts
        names[name] = [
            tuple(f"{prefix}.{e}.{proj}.weight" for proj in proj_names)  # type: ignore[misc]
            for e in range(first, first + local)
        ]
    return names


def _joined(parts: list[QuantizedWeight]) -> QuantizedWeight | QuantizedParts:
    """Row blocks of one layer as one quantized weight (per-part formats when they differ)."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    if any(_format(p) != _format(first) for p in parts):
        return QuantizedParts(parts)
    return stack_rows(parts)


def _format(weight: QuantizedWeight) -> tuple[int, bool, int, torch.dtype]:
    return weight.bits, weight.offsets is None, weight.group_size, weight.scales.dtype


class GGUFConfig(IntegerConfig):
    """`quantization="gguf"` (automatic for a .gguf file): each layer keeps the file's own
    integers where its tensor types have an exact scheme (`GGUFLayerQuantizer`)."""

    name = "gguf"

    recorded: GGUFLayerQuantizer | None = None  # None until the file is read (and for dummy)

    def gguf_observer(self, model: nn.Module) -> GGUFObserver:
        self.recorded = GGUFLayerQuantizer(model, keep_exact=self.keep_ints)
        return self.recorded.observe

    def process_model(self, model: nn.Module) -> None:
        recorded = self.recorded
        if self.keep_ints and recorded is not None:
            quantize_model(model, recorded.scheme_for, recorded.exact)
            if self.on_cpu:
                recorded.quantize_experts(model)
        self.finish(model)
