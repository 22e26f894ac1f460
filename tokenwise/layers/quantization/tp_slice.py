"""A tensor-parallel rank's slice of a checkpoint's quantized weights: the recorded integers,
scales and offsets cut exactly as the dense weight loaders cut the dense weight.

Why: a prequantized checkpoint (GPTQ, AWQ, compressed-tensors) or a GGUF file records each
layer's weight whole. Re-quantizing a rank's dense slice would round it again (round-to-nearest
with the checkpoint's scheme gives other scales than the checkpoint's, and other integers), so
a rank computing under TP would differ from one computing alone. Instead each rank takes its
part of the records, from the layout its layer already knows (`layers.linear`, `embedding`):
- column-parallel layers (`source_rows`, q/k/v and gate/up): each fused part's rows, the same
  range the weight loader copies, KV heads replicated past `tp > num_kv_heads` included;
- row-parallel layers (`source_columns`, o_proj and down_proj): columns, which must begin and
  end on group boundaries (int4 packs 32 values per 16 bytes, and its groups are multiples of
  32, so those are byte boundaries too); a channelwise record (one group per row,
  `group_size=-1`) gives each rank one group of its own width, with the row's scale;
- vocabulary-parallel embeddings and LM heads (`vocab_start` .. `vocab_end`): rows, and the
  zero padding rows the last rank(s) hold past the vocabulary (zero scales and offsets: 0).
GPTQ act-order (`input_perm`) on a row-parallel layer is exact too, though its rank's columns
lie scattered over every group in unequal numbers: `act_order_slice` pads each group's run of
them to whole kernel groups with columns that read a zero (vLLM instead gives every rank all the
groups' scales and its slice of `g_idx`, read per column by its kernels; ours need equal
consecutive groups). Records are cut as they are read (`RankSlices`), so a rank never holds
more of them than its slice. Where a slice cannot be taken exactly the layer falls back
(logged, naming the layer and why) to quantizing its dense slice with the checkpoint's scheme:
columns off the group boundaries of a record in input order.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from tokenwise.layers.quantization.act_order_slice import slice_act_order_columns
from tokenwise.layers.quantization.weight_only import QuantizedWeight, group_multiple, stack_rows
from tokenwise.layers.weight_utils import StackedMapping, checkpoint_names

logger = logging.getLogger(__name__)


class RankSlices:
    """Which layer, and which of its fused parts, each checkpoint weight loads into: so that a
    record is cut to this rank's slice as soon as it is read, and no rank keeps the whole
    model's records (one process: every record whole)."""

    def __init__(self, model: nn.Module, mapping: StackedMapping) -> None:
        names = {id(p): name for name, p in model.named_parameters()}
        # checkpoint name -> (layer name, layer, its shard id, how many checkpoint tensors)
        self.owners: dict[str, tuple[str, nn.Module, object, int]] = {}
        for name, module in model.named_modules():
            weight = module._parameters.get("weight")
            if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
                continue
            parts = checkpoint_names(names[id(weight)], mapping)
            for shard, part in parts.items():
                self.owners.setdefault(part, (name, module, shard, len(parts)))

    def take(self, checkpoint_name: str, record: QuantizedWeight) -> QuantizedWeight | None:
        """This rank's slice of the record of `checkpoint_name`; None (logged) where there is
        no exact one, so that its layer is quantized from its dense slice instead."""
        owner = self.owners.get(checkpoint_name)
        if owner is None:
            return record  # no layer weight (the loader refuses it, or it stays unused)
        return rank_part(*owner, record)


def rank_part(
    name: str, module: nn.Module, shard: object, count: int, part: QuantizedWeight
) -> QuantizedWeight | None:
    """This rank's slice of one recorded checkpoint tensor of layer `module` (`shard`: its
    shard id in the model's `load_weights`, None for an unfused one; `count`: how many
    checkpoint tensors the layer's weight has); None (logged) where no exact slice exists."""
    if getattr(module, "tp_size", 1) == 1:
        return part
    if hasattr(module, "source_rows"):  # column-parallel: the part's rows
        full = list(module.full_output_sizes)
        if count == 1 and len(full) > 1:  # one fused checkpoint tensor: its parts in order
            if part.shape[0] != sum(full):
                return _declined(name, f"it has {part.shape[0]} rows, not {sum(full)}")
            starts = [sum(full[:i]) for i in range(len(full))]
            pieces = [slice_rows(part, s, n) for s, n in zip(starts, full, strict=True)]
            return stack_rows([slice_rows(p, *module.source_rows(i)) for i, p in enumerate(pieces)])
        index = 0 if shard is None else module.shard_index(shard)
        if not isinstance(index, int):  # a tensor of several parts (Gated DeltaNet's `qkvz`)
            return _declined(name, f"part {shard!r} spans several of its fused parts")
        if part.shape[0] != full[index]:
            return _declined(name, f"part {shard} has {part.shape[0]} rows, not {full[index]}")
        return slice_rows(part, *module.source_rows(index))
    if hasattr(module, "source_columns"):  # row-parallel: columns
        start, width = module.source_columns()
        if part.input_perm is not None:  # act-order: any columns, in padded groups
            return slice_act_order_columns(part, start, width)
        why = _columns_refused(part, start, width)
        return _declined(name, why) if why is not None else slice_columns(part, start, width)
    if hasattr(module, "vocab_start"):  # vocabulary-parallel: rows, and zero padding rows
        start, end = module.vocab_start, module.vocab_end
        mine = slice_rows(part, start, end - start)
        return pad_rows(mine, module.weight.shape[0] - (end - start))
    return _declined(name, f"{type(module).__name__} has no known tensor-parallel layout")


def slice_rows(weight: QuantizedWeight, start: int, size: int) -> QuantizedWeight:
    """Rows `start .. start + size` (outputs): every row keeps its own groups whole."""
    _check_range("rows", start, size, weight.shape[0])
    rows = slice(start, start + size)
    offsets = None if weight.offsets is None else weight.offsets[rows].contiguous()
    return QuantizedWeight(
        qweight=weight.qweight[rows].contiguous(),
        scales=weight.scales[rows].contiguous(),
        offsets=offsets,
        bits=weight.bits,
        group_size=weight.group_size,
        shape=(size, weight.shape[1]),
        input_perm=weight.input_perm,
        input_size=weight.input_size,
    )


def slice_columns(weight: QuantizedWeight, start: int, width: int) -> QuantizedWeight:
    """Input columns `start .. start + width`, on group boundaries (`_columns_refused`), of a
    record in input order (act-order ones: `slice_act_order_columns`)."""
    if weight.input_perm is not None:
        raise ValueError("an act-order record's columns are sliced by slice_act_order_columns")
    _check_range("columns", start, width, weight.shape[1])
    g = weight.group_size
    channelwise = g == weight.shape[1]  # one group per row: every slice keeps its scale
    groups = slice(0, 1) if channelwise else slice(start // g, (start + width) // g)
    per_byte = 2 if weight.bits == 4 else 1  # int4: block-aligned, so bytes in column order
    stored = slice(start // per_byte, (start + width) // per_byte)
    offsets = None if weight.offsets is None else weight.offsets[:, groups].contiguous()
    return QuantizedWeight(
        qweight=weight.qweight[:, stored].contiguous(),
        scales=weight.scales[:, groups].contiguous(),
        offsets=offsets,
        bits=weight.bits,
        group_size=width if channelwise else g,
        shape=(weight.shape[0], width),
    )


def pad_rows(weight: QuantizedWeight, count: int) -> QuantizedWeight:
    """`count` rows of value 0 appended (zero scales and offsets: `q * 0 + 0`, any q)."""
    if count == 0:
        return weight

    def grow(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.new_zeros(count, *t.shape[1:])])

    return QuantizedWeight(
        qweight=grow(weight.qweight),
        scales=grow(weight.scales),
        offsets=None if weight.offsets is None else grow(weight.offsets),
        bits=weight.bits,
        group_size=weight.group_size,
        shape=(weight.shape[0] + count, weight.shape[1]),
    )


def _columns_refused(weight: QuantizedWeight, start: int, width: int) -> str | None:
    """Why columns `start .. start + width` are no exact slice of `weight` (in input order);
    None if they are."""
    g = weight.group_size
    if g == weight.shape[1]:  # channelwise: the slice is one group of its own width
        multiple = group_multiple(weight.bits)
        if start % multiple or width % multiple:
            return f"its slice (columns {start}..{start + width}) is not in blocks of {multiple}"
        return None
    if start % g or width % g:
        return f"its slice (columns {start}..{start + width}) is not on its groups of {g}"
    return None


def _check_range(what: str, start: int, size: int, total: int) -> None:
    """A slice past the record's end would hand the kernels a shape its tensors do not have."""
    if start < 0 or size < 0 or start + size > total:
        raise ValueError(f"{what} {start}..{start + size} are not within the record's {total}")


def _declined(name: str, why: str) -> None:
    logger.info("%s is quantized again from its dense slice on this rank: %s", name, why)
    return None
