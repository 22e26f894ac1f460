"""A row-parallel rank's slice of a GPTQ act-order record (`act_order_slice`): the checkpoint's
integers, scales and offsets in padded groups, whose effective weight is the dense slice exactly.

The records are built from random integers, zero points and float16 scales with act-order
groups (`test_gptq_awq._groups`: GPTQ's `g_idx[perm[i]] = i // G`), and checked against the
definition `(q - z) * s` (`group_dense`) cut to the rank's columns; the end-to-end check against
HF at TP=2 is in test_tp_exact.py.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from tests.quantization.test_gptq_awq import _groups
from tokenwise.layers.quantization.act_order_slice import kernel_group_size, kernel_groups
from tokenwise.layers.quantization.prequantized import group_dense, integer_weight
from tokenwise.layers.quantization.tp_slice import rank_part
from tokenwise.layers.quantization.weight_only import reference_dequantize

N, K = 24, 256


def _record(bits: int, group: int, zeros: str, seed: int) -> tuple[object, torch.Tensor, object]:
    """(record, its dense weight, each input column's group). `zeros`: "random", "midpoint"
    (symmetric: no offsets kept) or "v1-quirk" (some zero points 2^bits, which no stored
    integer reaches: GPTQ v1's zero 0 read back)."""
    gen = torch.Generator().manual_seed(seed)
    top = 1 << bits
    groups = _groups("model.layers.0.mlp.down_proj.weight", K, act_order=True, group=group)
    q = torch.randint(0, top, (N, K), generator=gen)
    z = torch.randint(0, top, (N, K // group), generator=gen)
    if zeros == "midpoint":
        z = torch.full_like(z, top // 2)
    elif zeros == "v1-quirk":
        z[::3] = top
    s = (torch.rand(N, K // group, generator=gen) / 10 + 0.01).half()
    record = integer_weight("down_proj", q, z, s, bits, groups, signed=False)
    assert record is not None and record.input_perm is not None
    return record, group_dense(q, z, s, groups), groups


def _rank(tp: int, rank: int, record: object) -> object:
    width = K // tp
    layer = SimpleNamespace(tp_size=tp, source_columns=lambda: (rank * width, width))
    mine = rank_part("model.layers.0.mlp.down_proj", layer, None, 1, record)
    assert mine is not None
    return mine


@pytest.mark.parametrize(
    ("bits", "group", "zeros", "tp"),
    [
        (4, 32, "random", 2),
        (4, 64, "midpoint", 2),
        (4, 32, "v1-quirk", 4),
        (8, 32, "random", 2),
        (8, 64, "midpoint", 4),
    ],
)
def test_each_rank_holds_its_columns_exactly(bits: int, group: int, zeros: str, tp: int) -> None:
    """Every rank: effective dense weight == the dense slice (`torch.equal`, kernel and torch
    dequantizers), each kernel group only columns of one checkpoint group with that group's
    scale and offset, padding columns dequantized to 0 where the zero point is storable, and
    products equal to the dense slice's on the kernel's row counts and the dense path's."""
    record, dense, groups = _record(bits, group, zeros, seed=bits + group + tp)
    width = K // tp
    for rank in range(tp):
        mine, want = _rank(tp, rank, record), dense[:, rank * width : (rank + 1) * width]
        assert mine.in_features == width and mine.shape[1] % mine.group_size == 0
        assert mine.group_size % (32 if bits == 4 else 16) == 0
        assert torch.equal(mine.dequantize(torch.float32), want)
        assert torch.equal(reference_dequantize(mine), want)
        real = mine.input_perm < width
        column_group = groups[rank * width + mine.input_perm.clamp(max=width - 1)]
        for j in range(mine.shape[1] // mine.group_size):
            block = slice(j * mine.group_size, (j + 1) * mine.group_size)
            owners = column_group[block][real[block]].unique()
            if owners.numel() == 0:  # all padding (row length aligned): zeros, any integer
                assert not mine.scales[:, j].any(), f"rank {rank} kernel group {j}"
                continue
            assert owners.numel() == 1, f"rank {rank} kernel group {j} mixes groups"
            assert torch.equal(mine.scales[:, j].float(), record.scales[:, owners[0]].float())
            if record.offsets is not None:
                assert torch.equal(mine.offsets[:, j], record.offsets[:, owners[0]])
        if zeros != "v1-quirk":  # a zero point of 2^bits has no stored integer: not 0 there
            stored = replace(mine, input_perm=None, input_size=None).dequantize()
            assert not bool(stored[:, ~real].any()), f"rank {rank}: padding is not 0"
        gen = torch.Generator().manual_seed(rank)
        for rows in (1, 5, 40):  # kernel; blocks of 8; the dequantized matmul
            x = torch.randn(rows, width, generator=gen)
            expected = torch.nn.functional.linear(x, want)
            atol = 1e-4 * float(expected.abs().max().clamp(min=1))
            torch.testing.assert_close(mine.linear(x, None), expected, atol=atol, rtol=0)


@pytest.mark.parametrize(
    ("counts", "bits", "scale_bytes", "size"),
    [
        # 2 runs of 33: groups of 32 -> 4 groups, 128 columns, 64 + 8 bytes; of 64 -> 2 groups,
        # 128 columns, 64 + 4 bytes (fewer).
        ([33, 33], 4, 2, 64),
        # 40 + 3 x 8: groups of 32 -> 5 groups, 6 with the row aligned to 64: 192 columns,
        # 96 + 24 bytes; of 64 -> 4 groups, 256 columns, 128 + 16 bytes.
        ([40, 8, 0, 8, 8], 4, 4, 32),
        # 2 runs of 70, float32 scales and offsets: 32 -> 6 groups, 96 + 48 bytes; 64 -> 4
        # groups, 256 columns, 128 + 32; 128 -> 2 groups, 128 + 16 (a tie: the smaller
        # stays). 96 (2 groups, 96 + 16) is fewer bytes but no size the fast paths take.
        ([70, 70], 4, 8, 32),
    ],
)
def test_kernel_group_size_takes_the_fewest_bytes(
    counts: list[int], bits: int, scale_bytes: int, size: int
) -> None:
    assert kernel_group_size(torch.tensor(counts), bits, scale_bytes) == size


def test_rows_are_padded_to_whole_kernel_steps() -> None:
    """An odd number of groups of 32 gets one more, all padding (64-column rows: the fast
    paths' step); larger groups already are."""
    assert kernel_groups(torch.tensor([20]), 32) == 2
    assert kernel_groups(torch.tensor([40, 8, 0, 8, 8]), 32) == 6
    assert kernel_groups(torch.tensor([70, 70]), 128) == 2
