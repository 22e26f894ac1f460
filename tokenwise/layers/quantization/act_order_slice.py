"""A row-parallel rank's exact slice of a GPTQ act-order record (`desc_act`, a `g_idx` per input
column): the checkpoint's own integers, scales and offsets, laid out in equal groups.

Why this is not a plain column slice: an act-order record stores its columns sorted by group
(`QuantizedWeight.input_perm`), and a row-parallel layer (o_proj, down_proj) gives each rank a
range of the *input's* columns. Those lie scattered over every group, in unequal numbers, while
the kernel (`cpu_qgemv.c`) reads groups of one size, each group's columns consecutive.

What a rank holds instead: its columns in storage order (so sorted by group: one run of
consecutive columns per group), each run padded with columns that contribute exactly nothing
to a run of whole kernel groups, each kernel group with the scale (and offset) of the
checkpoint group it belongs to. A padding column reads a zero activation: its `input_perm`
entry is `input_size`, the index of a zero column the layer appends to its input. Its integer
is the group's zero point where the storage holds it, so the padded weight dequantizes to
exactly 0 too (a GPTQ v1 zero point of 2^bits does not fit; the zero activation alone keeps
the product exact). The runs may use one kernel group each or several (a checkpoint group of
70 columns is three kernel groups of 32 with its scale, or one of 96): `kernel_group_size`
takes the size whose integers, scales and offsets are fewest bytes.

The alternative, a kernel that looks each column's group up by `g_idx` as vLLM's GPTQ kernels
do, reads no padding, but it needs per-column scales inside the vectorized 32-value blocks
(AVX2, AVX-512, the int8-activation path), i.e. a second inner loop in every variant of the C
kernel. Padding costs bytes instead: for a 3072-column down_proj in groups of 128 split over
two ranks, 1536 columns per rank become ~1900 in groups of 32 (see the docstring of
`kernel_group_size` for the figures), and leaves the kernel, TP=1 and the other formats alone.
"""

from __future__ import annotations

import torch

from tokenwise.layers.quantization.weight_only import (
    QuantizedWeight,
    group_multiple,
    pack_int4,
    unpack_int4,
)


def slice_act_order_columns(weight: QuantizedWeight, start: int, width: int) -> QuantizedWeight:
    """Input columns `start .. start + width` of an act-order record, in equal kernel groups
    (padded as the module docstring says); its `input_size` is `width`."""
    perm = weight.input_perm
    if perm is None:
        raise ValueError("slice_act_order_columns needs a record with an input_perm")
    k = weight.shape[1]
    if start < 0 or width <= 0 or start + width > k:
        raise ValueError(f"columns {start}..{start + width} are not within the record's {k}")
    stored = torch.nonzero((perm >= start) & (perm < start + width)).flatten()  # group order
    owner = stored // weight.group_size  # the checkpoint group of each of the rank's columns
    counts = torch.bincount(owner, minlength=k // weight.group_size)
    scale_bytes = weight.scales.element_size() * (1 if weight.offsets is None else 2)
    size = kernel_group_size(counts, weight.bits, scale_bytes)
    blocks = (counts + size - 1) // size  # kernel groups per checkpoint group
    kernel_groups = torch.repeat_interleave(torch.arange(counts.numel()), blocks)
    # Where each checkpoint group's run begins among the padded columns, and each column's
    # place in its run (its index among the rank's columns minus its run's first index).
    run_start = (torch.cumsum(blocks, 0) - blocks) * size
    first = torch.cumsum(counts, 0) - counts
    dest = run_start[owner] + torch.arange(stored.numel()) - first[owner]
    columns = kernel_groups.numel() * size
    new_perm = torch.full((columns,), width, dtype=torch.int64)
    new_perm[dest] = perm[stored] - start
    values = _values(weight)
    padded = _zero_points(weight)[:, kernel_groups].repeat_interleave(size, dim=1)
    padded[:, dest] = values[:, stored]
    n = weight.shape[0]
    offsets = weight.offsets
    return QuantizedWeight(
        qweight=pack_int4(padded) if weight.bits == 4 else padded.contiguous(),
        scales=weight.scales[:, kernel_groups].contiguous(),
        offsets=None if offsets is None else offsets[:, kernel_groups].contiguous(),
        bits=weight.bits,
        group_size=size,
        shape=(n, columns),
        input_perm=new_perm,
        input_size=width,
    )


def kernel_group_size(counts: torch.Tensor, bits: int, scale_bytes: int) -> int:
    """The kernel group size (a multiple of the kernel's block, at most the longest run
    rounded up) that stores runs of `counts[g]` columns in the fewest bytes per row: each run
    rounded up to whole groups, `bits / 8` bytes a column and `scale_bytes` a group.

    Measured on random act-order groups of 128 over 3072 columns, two ranks of 1536 (int4,
    float16 scales and offsets): groups of 32, about 1.24x the columns and 1.24x the bytes of
    an unpadded slice; one padded group per checkpoint group would be 1.5x (the longest run,
    ~75, rounds up to 96)."""
    multiple = group_multiple(bits)
    present = counts[counts > 0]
    longest = int(present.max()) if present.numel() else multiple
    best, best_bytes = multiple, None
    for size in range(multiple, -(-longest // multiple) * multiple + 1, multiple):
        groups = int(((present + size - 1) // size).sum())
        total = groups * size * bits / 8 + groups * scale_bytes
        if best_bytes is None or total < best_bytes:
            best, best_bytes = size, total
    return best


def _values(weight: QuantizedWeight) -> torch.Tensor:
    """The stored integers `[N, K]` (int4: uint8 0..15; int8: int8), in storage order."""
    return unpack_int4(weight.qweight) if weight.bits == 4 else weight.qweight


def _zero_points(weight: QuantizedWeight) -> torch.Tensor:
    """Per row and checkpoint group, the stored integer that dequantizes to 0 (`q * s + o`),
    clamped to the storage's range where it lies outside (then the zero activation alone
    keeps a padding column's product 0); the integers' dtype."""
    s = weight.scales.float()
    if weight.offsets is None:  # the kernels' implicit offsets: -8 s (int4), 0 (int8)
        zero = torch.full_like(s, 8.0 if weight.bits == 4 else 0.0)
    else:  # o = -z s was exact in float32, so -o / s is z exactly; s = 0: any integer
        safe = torch.where(s == 0, torch.ones_like(s), s)
        zero = torch.where(s == 0, torch.zeros_like(s), -weight.offsets.float() / safe)
    low, high = (0, 15) if weight.bits == 4 else (-128, 127)
    return zero.round().clamp(low, high).to(_values(weight).dtype)
