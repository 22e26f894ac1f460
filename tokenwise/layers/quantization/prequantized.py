"""Checkpoints that arrive quantized (GPTQ, AWQ, compressed-tensors): their linear layers' tensors
turned into dense weights for the model's loader, and into exact `QuantizedWeight`s for the layers.

Why both, and in this order: a model's `load_weights` knows dense `...weight` tensors only, and
through them tensor parallelism, fused q/k/v and gate/up shards and LoRA already work. So
`PrequantizedCheckpoint.wrap` sits between the checkpoint and `load_weights`: it gathers each
layer's format tensors (`q_proj.qweight`, `q_proj.qzeros`, ...), hands the format (`gptq`, `awq`,
`compressed_tensors`) the group, yields the dense `q_proj.weight` it computes, and records the
layer's integers and scales as a `QuantizedWeight` under that name. After loading,
`quantize_model(model, scheme_for, exact)` puts each layer's recorded weight (a fused layer's
parts concatenated in row order) in place of the dense one, so the layers compute with the
checkpoint's own integers, never with re-rounded ones. Under tensor parallelism each rank
takes its slice of the records, cut as its layer's weight loader cuts the dense weight
(`tp_slice`, GPTQ act-order on a row-parallel layer in padded groups: `act_order_slice`); only
where no exact slice exists (columns off the group boundaries) is a layer quantized from its
dense slice with the checkpoint's scheme.

Exactness: every format dequantizes as `w = (q - z) * s` per group. The record keeps `q` and
`s`, and the offset `o = -z * s`; `q * s + o` equals `(q - z) * s` in float32 for float16 (and
bfloat16) scales, since both products and their difference fit float32's 24-bit mantissa.
Offsets are kept in float16 only where float16 holds every `-z * s`; otherwise scales and offsets
are float32 (the kernel reads both). A layer whose zero point is the format's midpoint
everywhere (symmetric) keeps no offsets: the kernels' int4 default is `o = -8 s`, int8's `o = 0`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from tokenwise.layers.quantization.fp8 import FP8Weight
from tokenwise.layers.quantization.fp8_loading import combine, rank_slice
from tokenwise.layers.quantization.schemes import Scheme
from tokenwise.layers.quantization.tp_slice import RankSlices
from tokenwise.layers.quantization.weight_only import (
    QuantizedParts,
    QuantizedWeight,
    group_multiple,
    pack_int4,
)
from tokenwise.layers.weight_utils import (
    CheckpointTensor,
    StackedMapping,
    checkpoint_names,
    materialize,
)

logger = logging.getLogger(__name__)


@dataclass
class Converted:
    """One layer's checkpoint tensors, converted: the dense weight (float32 `[N, K]`, columns in
    the input's order) and, where the layer's format fits a `QuantizedWeight`, that."""

    dense: torch.Tensor
    record: QuantizedWeight | None
    fp8: FP8Weight | None = None  # float8 weights (compressed-tensors FP8), kept as such


# (layer name, its tensors by suffix) -> the converted layer.
Converter = Callable[[str, dict[str, torch.Tensor]], Converted]


def unpack_int32(
    packed: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None
) -> torch.Tensor:
    """int32 words holding `32 / bits` values each, low bits first, along `dim` (0 or 1) ->
    int32 values, that dim `32 / bits` times longer. `order[p]`: which of a word's values
    its p-th field holds (AWQ interleaves them); None: field p holds value p."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    words = packed.to(torch.int32)
    if dim == 0:
        words = words.t()
    fields = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [rows, words, per_word]
    if order is not None:
        values = torch.empty_like(fields)
        values[..., list(order)] = fields
        fields = values
    values = fields.reshape(words.shape[0], words.shape[1] * per_word)
    return values.t() if dim == 0 else values


def group_dense(
    q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, groups: torch.Tensor
) -> torch.Tensor:
    """float32 `[N, K]` `(q - z) * s`, the definition every format states: `q` integers `[N, K]`,
    `zeros` (integers) and `scales` `[N, num_groups]`, `groups` the group of
    each input column (`[K]`, int64)."""
    s = scales.float()[:, groups]
    z = zeros.to(torch.float32)[:, groups]
    return (q.to(torch.float32) - z) * s


def integer_weight(
    name: str,
    q: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    groups: torch.Tensor,
    signed: bool,
) -> QuantizedWeight | None:
    """The exact `QuantizedWeight` of `w = (q - z) * s` (arguments as in `group_dense`), or None
    (logged) where its groups do not fit one: a group size the kernels do not take, or groups of
    unequal sizes. `signed`: q and z run over -2^(bits-1)..2^(bits-1)-1 (compressed-tensors),
    else over 0..2^bits-1 (GPTQ, AWQ)."""
    n, k = q.shape
    counts = torch.bincount(groups, minlength=scales.shape[1])
    group_size = int(counts[0])
    multiple = group_multiple(bits)
    if bool((counts != group_size).any()) or group_size % multiple or k % group_size:
        logger.info(
            "%s stays dense: its groups (%s values) are not equal multiples of %d, which "
            "int%d kernels need",
            name,
            sorted(set(counts.tolist())),
            multiple,
            bits,
        )
        return None
    perm = None
    if not torch.equal(groups, torch.arange(k) // group_size):
        perm = torch.sort(groups, stable=True).indices  # stored column j is input column perm[j]
        q = q[:, perm]
    # Storage is unsigned 0..15 for int4 and signed -128..127 for int8: shift q and z alike.
    if bits == 4:
        shift = 8 if signed else 0
        stored = (q + shift).to(torch.uint8)
        qweight = pack_int4(stored)
        midpoint = 8
    else:
        shift = 0 if signed else -128
        qweight = (q + shift).to(torch.int8).contiguous()
        midpoint = 0
    z = zeros.to(torch.int32) + shift
    s32 = scales.float()
    offsets = None if bool((z == midpoint).all()) else -z.float() * s32
    scales_out, offsets_out = _compact(s32, offsets)
    return QuantizedWeight(
        qweight=qweight,
        scales=scales_out,
        offsets=offsets_out,
        bits=bits,
        group_size=group_size,
        shape=(n, k),
        input_perm=perm,
    )


def _compact(
    scales: torch.Tensor, offsets: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scales and offsets in float16 where float16 holds all of them exactly, else float32."""
    parts = [scales] if offsets is None else [scales, offsets]
    if all(torch.equal(t.half().float(), t) for t in parts):
        return scales.half().contiguous(), None if offsets is None else offsets.half().contiguous()
    return scales.contiguous(), offsets


class PrequantizedCheckpoint:
    """Converts a quantized checkpoint's layers while it loads; keeps the exact records."""

    def __init__(
        self,
        model: nn.Module,
        suffixes: tuple[str, ...],
        marker: str,
        convert: Converter,
        keep_exact: bool,
        dropped: tuple[str, ...] = (),
        keep_fp8: bool = False,
    ) -> None:
        """`suffixes`: the tensor names a quantized layer may have (`qweight`, `scales`, ...);
        a layer is quantized when it has `marker`. `dropped`: suffixes read and ignored (a
        static activation scale, where tokenwise keeps activations in floating point).
        `keep_fp8`: keep FP8 layers' records (`fp8_record_for`), else they stay dense."""
        self.mapping: StackedMapping = getattr(model, "stacked_params_mapping", ())
        self.param_names = {id(p): name for name, p in model.named_parameters()}
        self.suffixes = suffixes
        self.marker = marker
        self.convert = convert
        self.keep_exact = keep_exact
        self.dropped = dropped
        self.records: dict[str, QuantizedWeight] = {}
        self.keep_fp8 = keep_fp8
        self.fp8_records: dict[str, FP8Weight] = {}
        self.slices = RankSlices(model, self.mapping)
        # Each recorded tensor's scheme (what a layer without an exact record is quantized with).
        self.schemes: dict[str, _Kind] = {}

    def wrap(
        self, weights: Iterable[tuple[str, CheckpointTensor]], names: Iterable[str]
    ) -> Iterator[tuple[str, CheckpointTensor]]:
        """`weights` with each quantized layer's tensors replaced by its dense `weight`, yielded
        once the last of them (by `names`, every tensor of the checkpoint) has been read."""
        names = set(names)
        expected: dict[str, set[str]] = {}
        for name in names:
            layer, _, suffix = name.rpartition(".")
            if suffix in self.suffixes and f"{layer}.{self.marker}" in names:
                expected.setdefault(layer, set()).add(suffix)
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in weights:
            layer, _, suffix = name.rpartition(".")
            if layer not in expected or suffix not in expected[layer]:
                yield name, tensor
                continue
            parts = pending.setdefault(layer, {})
            parts[suffix] = materialize(tensor)
            if parts.keys() == expected[layer]:
                del pending[layer]
                yield f"{layer}.weight", self._convert(layer, parts)
        if pending:
            layer, parts = next(iter(pending.items()))
            missing = sorted(expected[layer] - parts.keys())
            raise ValueError(f"checkpoint tensors {layer}.{missing} were listed but never read")

    def _convert(self, layer: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        for suffix in self.dropped:
            parts.pop(suffix, None)
        try:
            converted = self.convert(layer, parts)
        except ValueError as e:
            raise ValueError(f"cannot convert the quantized tensors of {layer!r}: {e}") from e
        if converted.fp8 is not None and self.keep_fp8:
            name = f"{layer}.weight"
            self.fp8_records[name] = rank_slice(name, self.slices, converted.fp8)
        record = converted.record
        if record is not None:
            self.schemes[f"{layer}.weight"] = _Kind(
                record.bits, record.offsets is None, record.group_size, record.input_perm
            )
            mine = self.slices.take(f"{layer}.weight", record) if self.keep_exact else None
            if mine is not None:
                self.records[f"{layer}.weight"] = mine  # this rank's slice (`tp_slice`)
        return converted.dense

    def _names(self, module: nn.Module) -> list[str]:
        """The checkpoint names of a layer's weight, in the fused layer's row order."""
        name = self.param_names[id(module.weight)]  # a tied head's weight is the embedding's
        return list(checkpoint_names(name, self.mapping).values())

    def fp8_record_for(self, name: str, module: nn.Module) -> FP8Weight | QuantizedParts | None:
        """An FP8 layer's record (`fp8_loading.install`), its fused parts stacked."""
        found = [self.fp8_records.pop(part, None) for part in self._names(module)]
        if not found or any(r is None for r in found):
            return None
        return combine([r for r in found if r is not None])

    def scheme_for(self, name: str, module: nn.Module) -> Scheme | None:
        """The checkpoint's scheme for a layer whose parts were all recorded alike; None (kept
        dense) otherwise, e.g. an unquantized LM head or parts with different input orders."""
        kinds = [self.schemes.get(part) for part in self._names(module)]
        if not kinds or any(k is None for k in kinds):
            return None
        first = kinds[0]
        assert first is not None
        for kind in kinds[1:]:
            assert kind is not None
            same = (kind.bits, kind.group_size) == (first.bits, first.group_size)
            if not same or not _same_perm(kind.input_perm, first.input_perm):
                logger.info("%s stays dense: its fused parts are quantized differently", name)
                return None
        symmetric = all(k.symmetric for k in kinds)  # type: ignore[union-attr]
        return Scheme(first.bits, symmetric, first.group_size)

    def exact(self, name: str, module: nn.Module, scheme: Scheme) -> QuantizedWeight | None:
        """The layer's recorded weight (under TP this rank's slice of it), its parts concatenated;
        None where a part has no record (no exact slice) or the layer holds another shape."""
        found = [self.records.get(part) for part in self._names(module)]
        parts = [p for p in found if p is not None]
        if not parts or len(parts) != len(found):
            return None
        rows = sum(p.shape[0] for p in parts)
        if (rows, parts[0].in_features) != tuple(module.weight.shape):
            return None
        dtype = torch.float32 if any(p.scales.dtype == torch.float32 for p in parts) else None
        dtype = dtype or torch.float16
        offsets = None
        if not scheme.symmetric:
            offsets = torch.cat([_offsets(p).to(dtype) for p in parts])
        first = parts[0]
        return QuantizedWeight(
            qweight=torch.cat([p.qweight for p in parts]),
            scales=torch.cat([p.scales.to(dtype) for p in parts]),
            offsets=offsets,
            bits=first.bits,
            group_size=first.group_size,
            shape=(rows, first.shape[1]),
            input_perm=first.input_perm,
            input_size=first.input_size,
        )


@dataclass(frozen=True)
class _Kind:
    """What `scheme_for` needs of a record: its scheme, and its input order."""

    bits: int
    symmetric: bool
    group_size: int
    input_perm: torch.Tensor | None


def _offsets(weight: QuantizedWeight) -> torch.Tensor:
    """A record's offsets, the kernels' implicit ones (-8 s, or 0) where it keeps none."""
    if weight.offsets is not None:
        return weight.offsets
    s = weight.scales.float()
    return -8.0 * s if weight.bits == 4 else torch.zeros_like(s)


def _same_perm(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
