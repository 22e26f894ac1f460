"""Tensor-parallel layers in one process: each rank's slice, checked rank by rank.

The TP rank and size are set by hand (what `init_tp_group` would set), and the collectives are
replaced by summing / concatenating what every rank computed, so the sharded layers can be
compared with the full ones without processes (the engine tests run the real collectives).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F

import tokenwise.distributed.tp_state as tp_state
from tokenwise.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)


@contextmanager
def as_rank(rank: int, size: int) -> Iterator[None]:
    saved = tp_state._tp_rank, tp_state._tp_size
    tp_state._tp_rank, tp_state._tp_size = rank, size
    try:
        yield
    finally:
        tp_state._tp_rank, tp_state._tp_size = saved


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("tp", "kv_heads"), [(2, 2), (4, 2), (4, 1), (2, 4)])
def test_qkv_slices_heads_and_replicates_kv_heads_when_ranks_outnumber_them(
    tp: int, kv_heads: int
) -> None:
    heads, head_dim, hidden = 4, 3, 5
    q, k, v = (
        _randn(heads * head_dim, hidden),
        _randn(kv_heads * head_dim, hidden, seed=1),
        _randn(kv_heads * head_dim, hidden, seed=2),
    )
    for rank in range(tp):
        with as_rank(rank, tp):
            layer = QKVParallelLinear(hidden, head_dim, heads, kv_heads)
            for shard, w in (("q", q), ("k", k), ("v", v)):
                layer.weight.weight_loader(layer.weight, w, shard)
        local_q = heads // tp
        # Which KV head(s) this rank's query heads use in GQA: query head h uses h // group.
        group = heads // kv_heads
        kv_of_rank = sorted({h // group for h in range(rank * local_q, (rank + 1) * local_q)})
        assert layer.num_heads == local_q and layer.num_kv_heads == len(kv_of_rank)
        got_q, got_k, got_v = layer.weight.split(layer.output_sizes)
        torch.testing.assert_close(
            got_q, q[rank * local_q * head_dim : (rank + 1) * local_q * head_dim]
        )
        rows = torch.cat([torch.arange(h * head_dim, (h + 1) * head_dim) for h in kv_of_rank])
        torch.testing.assert_close(got_k, k[rows])
        torch.testing.assert_close(got_v, v[rows])


def test_column_and_row_parallel_products_add_up_to_the_full_layer() -> None:
    hidden, inter = 6, 8
    gate, up, down = (
        _randn(inter, hidden),
        _randn(inter, hidden, seed=1),
        _randn(hidden, inter, seed=2),
    )
    bias = _randn(hidden, seed=3)
    x = _randn(3, hidden, seed=4)
    full = F.linear(F.silu(x @ gate.T) * (x @ up.T), down, bias)
    partials = []
    for rank in range(2):
        with as_rank(rank, 2):
            merged = MergedColumnParallelLinear(hidden, [inter, inter])
            merged.weight.weight_loader(merged.weight, gate, 0)
            merged.weight.weight_loader(merged.weight, up, 1)
            row = RowParallelLinear(inter, hidden, bias=True)
            row.weight.weight_loader(row.weight, down)
            row.bias.weight_loader(row.bias, bias)
        assert merged.weight.shape == (inter, hidden) and row.weight.shape == (hidden, inter // 2)
        g, u = merged(x).split(merged.output_sizes, dim=-1)
        partials.append(F.linear(F.silu(g) * u, row.weight))
    # The all-reduce sums the partials; the bias is added once, after it.
    torch.testing.assert_close(partials[0] + partials[1] + bias, full)


def test_pre_fused_checkpoint_tensors_are_split_per_part() -> None:
    hidden, inter = 4, 6
    gate, up = _randn(inter, hidden), _randn(inter, hidden, seed=1)
    with as_rank(1, 2):
        layer = MergedColumnParallelLinear(hidden, [inter, inter])
        layer.weight.weight_loader(layer.weight, torch.cat([gate, up]))
        column = ColumnParallelLinear(hidden, inter)
        column.weight.weight_loader(column.weight, gate)
    torch.testing.assert_close(layer.weight, torch.cat([gate[3:], up[3:]]))
    torch.testing.assert_close(column.weight, gate[3:])


def test_vocab_split_with_padding_gives_the_full_embedding_and_logits() -> None:
    vocab, dim = 11, 4  # not divisible by 3: ranks hold 4, 4 and 3 rows (+1 padding)
    table = _randn(vocab, dim)
    ids = torch.tensor([0, 3, 4, 7, 8, 10])
    hidden = _randn(2, dim, seed=1)
    lookups, logits = [], []
    for rank in range(3):
        with as_rank(rank, 3):
            embed = VocabParallelEmbedding(vocab, dim)
            embed.weight.weight_loader(embed.weight, table)
            head = ParallelLMHead(vocab, dim, tie_to=embed)
        assert embed.weight.shape == (4, dim) and head.weight is embed.weight
        mine = (ids >= embed.vocab_start) & (ids < embed.vocab_end)
        local = torch.where(mine, ids - embed.vocab_start, 0)
        lookups.append(F.embedding(local, embed.weight) * mine[:, None])
        logits.append(F.linear(hidden, head.weight))
    torch.testing.assert_close(sum(lookups), F.embedding(ids, table))
    torch.testing.assert_close(torch.cat(logits, dim=-1)[:, :vocab], hidden @ table.T)
    assert torch.equal(logits[2][:, 3], torch.zeros(2))  # the padding row is zero


def test_counts_that_do_not_split_are_refused_with_the_numbers() -> None:
    with as_rank(0, 3):
        with pytest.raises(
            ValueError, match=r"num_attention_heads \(4\).*tensor_parallel_size \(3\)"
        ):
            QKVParallelLinear(8, 2, 4, 2)
        with pytest.raises(ValueError, match=r"input size \(8\).*tensor_parallel_size \(3\)"):
            RowParallelLinear(8, 4)
    with as_rank(0, 4), pytest.raises(ValueError, match=r"num_key_value_heads \(3\)"):
        QKVParallelLinear(8, 2, 12, 3)
