"""Tensor-parallel layers in one process: each rank's slice, checked rank by rank.

The TP rank and size are set by hand (what `init_tp_group` would set) while a layer is built;
its forward then runs either by hand (summing / concatenating what every rank computed) or in
one thread per rank, with torch.distributed's all-reduce / all-gather replaced by exchanges
between the threads, so `tp_state`'s own collective code runs. Real gloo ranks run the whole
models in tests/models/test_tensor_parallel_models.py.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

import tokenwise.distributed.tp_state as tp_state
from tokenwise.config import EngineConfig, ParallelConfig
from tokenwise.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from tokenwise.layers.fused_moe import FusedMoE
from tokenwise.layers.weight_utils import LazyTensor
from tokenwise.loader import iterate_safetensors
from tokenwise.models.llama import LlamaMLP

T = TypeVar("T")


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


def _swiglu_case(hidden: int, inter: int) -> tuple[torch.Tensor, ...]:
    """Gate, up and down weights, a down bias, an input and the unsharded SwiGLU MLP's output."""
    gate, up = _randn(inter, hidden), _randn(inter, hidden, seed=1)
    down, bias = _randn(hidden, inter, seed=2), _randn(hidden, seed=3)
    x = _randn(3, hidden, seed=4)
    return gate, up, down, bias, x, F.linear(F.silu(x @ gate.T) * (x @ up.T), down, bias)


def test_column_and_row_parallel_products_add_up_to_the_full_layer() -> None:
    hidden, inter = 6, 8
    gate, up, down, bias, x, full = _swiglu_case(hidden, inter)
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


def test_bias_of_column_layers_is_sliced_with_their_rows() -> None:
    heads, kv_heads, head_dim, hidden = 4, 1, 2, 6
    biases = {"q": _randn(heads * head_dim), "k": _randn(head_dim, seed=1)}
    biases["v"] = _randn(head_dim, seed=2)
    gate, up = _randn(8, seed=3), _randn(8, seed=4)
    for rank in range(2):
        with as_rank(rank, 2):
            qkv = QKVParallelLinear(hidden, head_dim, heads, kv_heads, bias=True)
            merged = MergedColumnParallelLinear(hidden, [8, 8], bias=True)
        for shard, b in biases.items():
            qkv.bias.weight_loader(qkv.bias, b, shard)
        merged.bias.weight_loader(merged.bias, gate, 0)
        merged.bias.weight_loader(merged.bias, up, 1)
        q_rows = slice(rank * 4, rank * 4 + 4)  # 2 query heads of 2 dims; the one KV head
        torch.testing.assert_close(
            qkv.bias, torch.cat([biases["q"][q_rows], biases["k"], biases["v"]])
        )
        torch.testing.assert_close(
            merged.bias, torch.cat([gate[rank * 4 : rank * 4 + 4], up[rank * 4 : rank * 4 + 4]])
        )


def test_loaders_refuse_a_checkpoint_tensor_of_the_wrong_full_shape() -> None:
    """A tensor already the size of this rank's slice is not the full tensor: refused."""
    with as_rank(1, 2):
        row = RowParallelLinear(8, 4)
        embed = VocabParallelEmbedding(10, 4)
        merged = MergedColumnParallelLinear(4, [6, 6])
    with pytest.raises(ValueError, match=r"expects \(4, 8\), the checkpoint has \(4, 4\)"):
        row.weight.weight_loader(row.weight, _randn(4, 4))
    with pytest.raises(ValueError, match=r"expects \(10, 4\), the checkpoint has \(5, 4\)"):
        embed.weight.weight_loader(embed.weight, _randn(5, 4))
    with pytest.raises(ValueError, match=r"expects \(6, 4\), the checkpoint has \(3, 4\)"):
        merged.weight.weight_loader(merged.weight, _randn(3, 4), 1)
    with pytest.raises(ValueError, match=r"expects \(12, 4\)"):
        merged.weight.weight_loader(merged.weight, _randn(6, 4))  # pre-fused, too short


def test_more_divisibility_errors_name_the_count_and_the_tp_size() -> None:
    with as_rank(0, 4):
        with pytest.raises(
            ValueError, match=r"intermediate_size \(6\).*tensor_parallel_size \(4\)"
        ):
            LlamaMLP(8, 6, "silu", bias=False)
        with pytest.raises(
            ValueError, match=r"tensor_parallel_size \(4\).*expert intermediate size \(30\)"
        ):
            FusedMoE(4, 2, 8, 30, EngineConfig(), renormalize=True)
    with (
        as_rank(0, 3),
        pytest.raises(
            ValueError, match=r"tensor_parallel_size \(3\) exceeds num_key_value_heads \(2\)"
        ),
    ):
        QKVParallelLinear(8, 2, 6, 2)
    dp2 = EngineConfig(parallel=ParallelConfig(data_parallel_size=2, data_parallel_rank=1))
    with as_rank(0, 2), pytest.raises(ValueError, match=r"4 ways.*\* tensor_parallel_size"):
        FusedMoE(4, 2, 8, 18, dp2, renormalize=True)  # 18 splits 2 ways, not 4


def test_vocab_smaller_than_the_rank_count_leaves_a_rank_only_padding() -> None:
    vocab, dim = 5, 3  # 4 ranks of 2 rows: [0, 2), [2, 4), [4, 5) + 1 padding, all padding
    table = _randn(vocab, dim)
    for rank, (start, end) in enumerate([(0, 2), (2, 4), (4, 5), (5, 5)]):
        with as_rank(rank, 4):
            head = ParallelLMHead(vocab, dim)
        head.weight.weight_loader(head.weight, table)
        assert (head.vocab_start, head.vocab_end) == (start, end)
        expected = torch.cat([table[start:end], torch.zeros(2 - (end - start), dim)])
        assert torch.equal(head.weight, expected)


# --- forwards with the collectives, one thread per rank --------------------------------------


class ThreadCollectives:
    """Stands in for a process group: each thread is one rank, exchanging through slots."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.slots: list[torch.Tensor | None] = [None] * size
        self.barrier = threading.Barrier(size, timeout=20)
        self.local = threading.local()
        self.calls = 0

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        self.slots[self.local.rank] = x.clone()
        self.barrier.wait()
        everyone = [t for t in self.slots if t is not None]
        self.barrier.wait()  # nobody overwrites a slot before all have read it
        if self.local.rank == 0:
            self.calls += 1
        return everyone

    def all_reduce(self, x: torch.Tensor, group: Any = None) -> None:
        x.copy_(torch.stack(self._exchange(x)).sum(0))

    def all_gather(self, parts: list[torch.Tensor], x: torch.Tensor, group: Any = None) -> None:
        for part, t in zip(parts, self._exchange(x), strict=True):
            part.copy_(t)


def run_ranks(monkeypatch: pytest.MonkeyPatch, work: list[Callable[[], T]]) -> list[T]:
    """Run `work[r]` as rank r of a TP group of len(work), each in its own thread."""
    group = ThreadCollectives(len(work))
    monkeypatch.setattr(tp_state.dist, "all_reduce", group.all_reduce)
    monkeypatch.setattr(tp_state.dist, "all_gather", group.all_gather)
    monkeypatch.setattr(tp_state, "_tp_group", object())
    monkeypatch.setattr(tp_state, "_tp_size", len(work))
    results: list[Any] = [None] * len(work)
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        group.local.rank = rank
        try:
            results[rank] = work[rank]()
        except BaseException as e:  # re-raised in the test's thread
            errors.append(e)
            group.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(len(work))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    if errors:
        raise errors[0]
    assert group.calls > 0, "no collective ran"
    return results


def test_row_parallel_forward_all_reduces_and_adds_the_bias_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hidden, inter = 6, 8
    gate, up, down, bias, x, full = _swiglu_case(hidden, inter)
    mlps = []
    for rank in range(2):
        with as_rank(rank, 2):
            mlp = LlamaMLP(hidden, inter, "silu", bias=False)
            mlp.down_proj = RowParallelLinear(inter, hidden, bias=True)
        mlp.gate_up_proj.weight.weight_loader(mlp.gate_up_proj.weight, gate, 0)
        mlp.gate_up_proj.weight.weight_loader(mlp.gate_up_proj.weight, up, 1)
        mlp.down_proj.weight.weight_loader(mlp.down_proj.weight, down)
        mlp.down_proj.bias.weight_loader(mlp.down_proj.bias, bias)
        mlps.append(mlp)
    outs = run_ranks(monkeypatch, [lambda m=m: m(x) for m in mlps])
    for out in outs:
        torch.testing.assert_close(out, full)


def test_vocab_parallel_embedding_and_head_forward_with_padding(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    vocab, dim = 11, 4  # 3 ranks of 4 rows, the last with one padding row
    table = _randn(vocab, dim)
    ids = torch.tensor([10, 0, 3, 4, 7, 8, 10, 5])
    layers = []
    for rank in range(3):
        with as_rank(rank, 3):
            embed = VocabParallelEmbedding(vocab, dim)
            head = ParallelLMHead(vocab, dim, tie_to=embed)
        embed.weight.weight_loader(embed.weight, table)
        layers.append((embed, head))

    def rank_work(embed: VocabParallelEmbedding, head: ParallelLMHead) -> tuple[torch.Tensor, ...]:
        hidden = embed(ids)
        return hidden, head(hidden)

    for hidden, logits in run_ranks(monkeypatch, [lambda p=p: rank_work(*p) for p in layers]):
        torch.testing.assert_close(hidden, F.embedding(ids, table))
        assert logits.dtype == torch.float32 and logits.shape == (len(ids), vocab)
        torch.testing.assert_close(logits, F.embedding(ids, table) @ table.T)


@pytest.mark.parametrize("stacked", [False, True], ids=["per-expert", "stacked"])
def test_fused_moe_under_tp_slices_every_expert_and_all_reduces(
    monkeypatch: pytest.MonkeyPatch, stacked: bool
) -> None:
    experts, top_k, hidden, inter = 4, 2, 8, 6
    w1, w3 = _randn(experts, inter, hidden, seed=1), _randn(experts, inter, hidden, seed=2)
    w2 = _randn(experts, hidden, inter, seed=3)
    x, logits = _randn(5, hidden, seed=4), _randn(5, experts, seed=5)
    full = FusedMoE(experts, top_k, hidden, inter, EngineConfig(), renormalize=True)
    full.w13_weight.data.copy_(torch.cat([w1, w3], dim=1))
    full.w2_weight.data.copy_(w2)
    expected = full(x, logits)
    layers = []
    for rank in range(2):
        with as_rank(rank, 2):
            moe = FusedMoE(experts, top_k, hidden, inter, EngineConfig(), renormalize=True)
        if stacked:
            moe.weight_loader(moe.w13_weight, torch.cat([w1, w3], dim=1), "w13", None)
            moe.weight_loader(moe.w2_weight, w2, "w2", None)
        else:
            for e in range(experts):
                moe.weight_loader(moe.w13_weight, w1[e], "w1", e)
                moe.weight_loader(moe.w13_weight, w3[e], "w3", e)
                moe.weight_loader(moe.w2_weight, w2[e], "w2", e)
        rows = slice(rank * 3, rank * 3 + 3)
        assert torch.equal(moe.w13_weight, torch.cat([w1[:, rows], w3[:, rows]], dim=1))
        assert torch.equal(moe.w2_weight, w2[:, :, rows])
        layers.append(moe)
    for out in run_ranks(monkeypatch, [lambda m=m: m(x, logits) for m in layers]):
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


# --- loading from safetensors slices ---------------------------------------------------------


class RecordingSlice:
    """A safetensors slice that records the shape of every read."""

    def __init__(self, inner: Any, reads: list[tuple[int, ...]]) -> None:
        self.inner, self.reads = inner, reads

    def get_shape(self) -> list[int]:
        return self.inner.get_shape()

    def __getitem__(self, index: Any) -> torch.Tensor:
        part = self.inner[index]
        self.reads.append(tuple(part.shape))
        return part


def test_lazy_tensor_reads_only_the_box_asked_for(tmp_path: Path) -> None:
    full = _randn(6, 5, 4)
    save_file({"t": full}, str(tmp_path / "t.safetensors"))
    reads: list[tuple[int, ...]] = []
    with safe_open(str(tmp_path / "t.safetensors"), framework="pt") as f:
        lazy = LazyTensor(RecordingSlice(f.get_slice("t"), reads), lambda: f.get_tensor("t"))
        assert lazy.shape == full.shape and lazy.dim() == 3
        box = lazy.narrow(0, 2, 3).narrow(2, 1, 2)
        assert box.shape == (3, 5, 2) and reads == []  # narrowing reads nothing
        torch.testing.assert_close(box.materialize(), full[2:5, :, 1:3])
        torch.testing.assert_close(box[1:, -1], full[3:5, -1, 1:3])
        torch.testing.assert_close(lazy[:, 2:4, 1], full[:, 2:4, 1])
        assert reads == [(3, 5, 2), (2, 1, 2), (6, 2, 1)]
        torch.testing.assert_close(lazy.materialize(), full)  # whole: read as a plain load
        assert len(reads) == 3
        with pytest.raises(IndexError, match=r"narrow\(1, 3, 3\) is out of range for size 5"):
            lazy.narrow(1, 3, 3)


def test_lazy_loading_reads_only_this_ranks_slices(tmp_path: Path) -> None:
    """Every sharded loader, fed lazy checkpoint tensors, reads just its rows / columns, and
    fills the same values as from full tensors."""
    hidden, head_dim, heads, kv_heads, inter, vocab, experts = 4, 2, 4, 2, 6, 7, 3
    tensors = {
        "q": _randn(heads * head_dim, hidden),
        "k": _randn(kv_heads * head_dim, hidden, seed=1),
        "v": _randn(kv_heads * head_dim, hidden, seed=2),
        "gate": _randn(inter, hidden, seed=3),
        "down": _randn(hidden, inter, seed=4),
        "embed": _randn(vocab, hidden, seed=5),
        "w13": _randn(experts, 2 * inter, hidden, seed=6),
        "w2": _randn(experts, hidden, inter, seed=7),
        "w1_0": _randn(inter, hidden, seed=8),
    }
    path = str(tmp_path / "model.safetensors")
    save_file(tensors, path)

    def build() -> dict[str, Any]:
        return {
            "qkv": QKVParallelLinear(hidden, head_dim, heads, kv_heads),
            "col": ColumnParallelLinear(hidden, inter),
            "row": RowParallelLinear(inter, hidden),
            "embed": VocabParallelEmbedding(vocab, hidden),
            "moe": FusedMoE(experts, 2, hidden, inter, EngineConfig(), renormalize=True),
        }

    def load(layers: dict[str, Any], get: Callable[[str], Any]) -> None:
        for shard in "qkv":
            layers["qkv"].weight.weight_loader(layers["qkv"].weight, get(shard), shard)
        layers["col"].weight.weight_loader(layers["col"].weight, get("gate"))
        layers["row"].weight.weight_loader(layers["row"].weight, get("down"))
        layers["embed"].weight.weight_loader(layers["embed"].weight, get("embed"))
        moe = layers["moe"]
        moe.weight_loader(moe.w13_weight, get("w13"), "w13", None)
        moe.weight_loader(moe.w2_weight, get("w2"), "w2", None)
        moe.weight_loader(moe.w13_weight, get("w1_0"), "w1", 0)

    reads: list[tuple[int, ...]] = []
    with as_rank(1, 2):
        eager, lazy = build(), build()
    load(eager, tensors.__getitem__)
    with safe_open(path, framework="pt") as f:

        def get(name: str) -> LazyTensor:
            def never() -> torch.Tensor:
                raise AssertionError(f"{name} was read whole")

            return LazyTensor(RecordingSlice(f.get_slice(name), reads), never)

        load(lazy, get)
    for key in eager:
        for (name, p), (_, q) in zip(
            eager[key].named_parameters(), lazy[key].named_parameters(), strict=True
        ):
            assert torch.equal(p, q), (key, name)
    assert reads == [
        (4, 4), (2, 4), (2, 4),  # q: 2 of 4 heads; k, v: 1 of 2 KV heads
        (3, 4), (4, 3), (3, 4),  # gate rows, down columns, embedding rows 4..7
        (3, 3, 4), (3, 3, 4), (3, 4, 3), (3, 4),  # experts: gate and up rows, down columns
    ]  # fmt: skip


def test_iterate_safetensors_lazy_gives_the_same_tensors(tmp_path: Path) -> None:
    tensors = {"a": _randn(3, 2), "b": _randn(5, seed=1)}
    save_file(tensors, str(tmp_path / "m.safetensors"))
    files = [str(tmp_path / "m.safetensors")]
    eager = dict(iterate_safetensors(files))
    seen = 0
    for name, lazy in iterate_safetensors(files, lazy=True):
        assert isinstance(lazy, LazyTensor)
        assert torch.equal(lazy.materialize(), eager[name])
        assert torch.equal(lazy.narrow(0, 1, 2).materialize(), eager[name][1:3])
        seen += 1
    assert seen == 2 and all(isinstance(t, torch.Tensor) for t in eager.values())
