"""A row-parallel rank's exact slice of a GPTQ act-order record (`desc_act`, a `g_idx` per input
column): the checkpoint's own integers, scales and offsets, laid out in equal groups.

Why this is not a plain column slice: an act-order record stores its columns sorted by group
(`QuantizedWeight.input_perm`), and a row-parallel layer (o_proj, down_proj) gives each rank a
range of the *input's* columns. Those lie scattered over every group, in unequal numbers, while
the kernel (`native/qgemv.c`) reads groups of one size, each group's columns consecutive.

What a rank holds instead: its columns in storage order (so sorted by group: one run of
consecutive columns per group), each run padded with columns that contribute exactly nothing
to a run of whole kernel groups, each kernel group with the scale (and offset) of the
checkpoint group it belongs to. A padding column reads a zero activation: its `input_perm`
entry is `input_size`, the index of a zero column the layer appends to its input. Its integer
is the group's zero point where the storage holds it, so the padded weight dequantizes to
exactly 0 too (a GPTQ v1 zero point of 2^bits does not fit; the zero activation alone keeps
the product exact). The runs may use one kernel group each or several (a run of 70 columns is
three kernel groups of 32 with its group's scale, two of 64 or one of 128): `kernel_group_size`
takes the size whose integers, scales and offsets are fewest bytes; the row is padded to the
64 columns the kernel's fast paths step by.

Chosen over the alternative, a kernel that looks each column's group up by `g_idx` as vLLM's
GPTQ kernels do, because it leaves the C kernel, TP=1 and every other format as they are: that
kernel reads no padding, but needs per-column scales inside its vectorized 32-value blocks
(AVX2, AVX-512, the int8-activation path), a second inner loop in every variant. The price is
the padding, measured by `benchmarks/act_order_tp.py` (random act-order groups of 128, int4,
float32 scales and offsets as GPTQ's `-z * s` usually need, rank 0 of TP=2, 1 row, 2 threads):
Qwen3-0.6B down_proj's 1536 columns become 2240 (1.7x the bytes of the same slice in groups of
128), 1.4x the time in float32 and 2x in bfloat16; Llama-3-8B's 7168 become 10560 (1.7x the
bytes), 1.6x / 2.5x the time; at TP=4 a rank's runs are shorter and the padding relatively
larger. A group-index kernel would read about the unpadded bytes (the `unpadded` figures).
"""

from __future__ import annotations

import torch

from tokenwise.layers.quantization.weight_only import QuantizedWeight, pack_int4, unpack_int4

# The kernel's smallest fast group (int4's 32-value block; the int8-activation path's block for
# both widths), and what its fast paths want the row length to be a multiple of.
KERNEL_BLOCK = 32
ALIGN = 64


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
    group_of = stored // weight.group_size  # the checkpoint group of each of the rank's columns
    counts = torch.bincount(group_of, minlength=k // weight.group_size)
    scale_bytes = weight.scales.element_size() * (1 if weight.offsets is None else 2)
    size = kernel_group_size(counts, weight.bits, scale_bytes)
    blocks = (counts + size - 1) // size  # kernel groups per checkpoint group
    owners = torch.repeat_interleave(torch.arange(counts.numel()), blocks)  # per kernel group
    spare = kernel_groups(counts, size) - owners.numel()  # all padding: scale 0, offset 0
    # Where each checkpoint group's run begins among the padded columns, and each column's
    # place in its run (its index among the rank's columns minus its run's first index).
    run_start = (torch.cumsum(blocks, 0) - blocks) * size
    first = torch.cumsum(counts, 0) - counts
    dest = run_start[group_of] + torch.arange(stored.numel()) - first[group_of]
    columns = (owners.numel() + spare) * size
    new_perm = torch.full((columns,), width, dtype=torch.int64)
    new_perm[dest] = perm[stored] - start
    padded = _per_group(_zero_points(weight), owners, spare).repeat_interleave(size, dim=1)
    padded[:, dest] = _values(weight)[:, stored]
    offsets = weight.offsets
    return QuantizedWeight(
        qweight=pack_int4(padded) if weight.bits == 4 else padded.contiguous(),
        scales=_per_group(weight.scales, owners, spare),
        offsets=None if offsets is None else _per_group(offsets, owners, spare),
        bits=weight.bits,
        group_size=size,
        shape=(weight.shape[0], columns),
        input_perm=new_perm,
        input_size=width,
    )


def kernel_group_size(counts: torch.Tensor, bits: int, scale_bytes: int) -> int:
    """The kernel group size that stores runs of `counts[g]` columns in the fewest bytes per
    row: each run rounded up to whole groups, the total to `ALIGN` columns (`kernel_groups`),
    `bits / 8` bytes a column and `scale_bytes` a group. Candidates are the sizes the kernel's
    fast paths take (`native/qgemv.c`): 32 times a power of two, up to the longest run. (Other
    sizes take slower loops: Llama-3-8B's padded down_proj slice in groups of 96 measured 2.2 ms
    per bf16 row, in groups of 32, 64 or 128 1.6-1.8 ms.)"""
    top = max(int(counts.max()) if counts.numel() else 1, 1)
    best, best_bytes, size = KERNEL_BLOCK, None, KERNEL_BLOCK
    while True:
        groups = kernel_groups(counts, size)
        total = groups * size * bits / 8 + groups * scale_bytes
        if best_bytes is None or total < best_bytes:
            best, best_bytes = size, total
        if size >= top:
            return best
        size *= 2


def kernel_groups(counts: torch.Tensor, size: int) -> int:
    """How many kernel groups of `size` hold runs of `counts[g]` columns, each run in whole
    groups, the total padded to a multiple of `ALIGN` columns with all-padding groups."""
    groups = int(((counts + size - 1) // size).sum())
    per_align = max(ALIGN // size, 1)
    return -(-groups // per_align) * per_align


def _per_group(params: torch.Tensor, owners: torch.Tensor, spare: int) -> torch.Tensor:
    """Each kernel group's column of `params` (`[N, groups]`: scales, offsets or zero points):
    its checkpoint group's, then `spare` all-padding groups of zeros (a zero scale and offset
    give 0 for any integer)."""
    picked = params[:, owners]
    return torch.cat([picked, picked.new_zeros(params.shape[0], spare)], dim=1).contiguous()


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
    return zero.round().clamp(low, high).to(torch.uint8 if weight.bits == 4 else torch.int8)
