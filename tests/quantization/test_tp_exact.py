"""Under tensor parallelism each rank computes with its slice of a quantized checkpoint's own
integers, scales and offsets (`tp_slice`), not with its dense slice rounded again.

One spawn of two gloo ranks loads five tiny checkpoints: GPTQ (v1, asymmetric), GPTQ with
act-order, AWQ, compressed-tensors int8 per channel (one group per row, where the package is
installed), a GGUF Q4_0 file with one KV head (replicated on both ranks) and a GGUF K-quant
file as Q4_K_M mixes it (Q4_K; v and down_proj in Q6_K, int8 groups of 16: q/k/v then keeps
one weight per part). For every quantized layer each rank must
hold exactly (`torch.equal`) the slice of what one process holds, cut by the head / vocabulary
layout as `test_tensor_parallel_models.expected_shard` states it independently of the layers;
its logits must be HF's (fp32, 1e-4) and its greedy tokens HF's and one process's.
Re-quantizing a slice (what tokenwise did before) gives other scales: these equalities fail.

GPTQ act-order on a row-parallel layer (o_proj, down_proj), whose rank's columns lie scattered
over all groups, is held in padded groups (`act_order_slice`): there each rank's effective dense
weight (dequantized, its input order undone) must equal the slice of one process's and of HF's
exactly, every scale / offset column must be one of the checkpoint's, and the logits and tokens
are checked as for the other cases. (Before, those layers were rounded again from the dense
slice: other weights, and these equalities fail.)
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from tests.distributed._spawn import run_ranks
from tests.engine._fixtures import hf_model
from tests.models.test_tensor_parallel_models import expected_shard
from tests.quantization import _tp_exact_worker as worker
from tests.quantization._gguf_files import write_gguf
from tests.quantization.test_gptq_awq import _checkpoints
from tests.tiny_checkpoints import build_tiny_checkpoint
from tokenwise.layers.quantization.weight_only import quantize

pytestmark = pytest.mark.usefixtures("exact_fp32_activations")  # compared with transformers

Q = gguf.GGMLQuantizationType
TP = worker.TP_SIZE
ATOL = 1e-4
FIELDS = ("qweight", "scales", "offsets", "input_perm")
ROW_PARALLEL = ("o_proj", "down_proj")


def _gguf(tmp_path: Path, qtype: Any, types: dict[str, Any] | None = None, **extra: Any) -> str:
    hf_dir = build_tiny_checkpoint(tmp_path, "LlamaForCausalLM", **extra)
    return write_gguf(hf_dir, str(tmp_path / f"{qtype.name}.gguf"), qtype, types=types)


def _hf_gguf(path: str) -> Any:
    from transformers import AutoModelForCausalLM

    directory, name = os.path.split(path)
    return AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=torch.float32
    ).eval()


@torch.no_grad()
def _hf_logits_and_greedy(hf: Any) -> tuple[torch.Tensor, list[int]]:
    seq = worker.prompt_ids()
    logits = hf(seq[None]).logits[0]
    tokens: list[int] = []
    for _ in range(worker.GREEDY_STEPS):
        tokens.append(int(hf(seq[None]).logits[0, -1].argmax()))
        seq = torch.cat([seq, torch.tensor(tokens[-1:])])
    return logits, tokens


def _cases(tmp_path: Path) -> dict[str, tuple[str, Any, bool]]:
    """case -> (checkpoint for tokenwise, HF model of the same weights, act-order)."""
    cases: dict[str, tuple[str, Any, bool]] = {}
    for case, method, act_order, fmt in (
        ("gptq", "gptq", False, "gptq"),
        ("gptq-act-order", "gptq", True, "gptq_v2"),
        ("awq", "awq", False, "gptq"),
    ):
        (tmp_path / case).mkdir()
        quantized, reference, _ = _checkpoints(tmp_path / case, method, False, act_order, fmt)
        cases[case] = (quantized, hf_model(reference), act_order)
    if importlib.util.find_spec("compressed_tensors") is not None:
        from tests.quantization import test_compressed_tensors as ct

        (tmp_path / "ct").mkdir()  # int8 per output channel: one group per row
        quantized, reference = ct._checkpoints(tmp_path / "ct", "w8a16-channel")
        cases["compressed-tensors-channel"] = (quantized, hf_model(reference), False)
    (tmp_path / "q4_0").mkdir()
    path = _gguf(tmp_path / "q4_0", Q.Q4_0, num_key_value_heads=1)
    cases["gguf-q4_0-kv1"] = (path, _hf_gguf(path), False)
    (tmp_path / "k").mkdir()
    wide = {"hidden_size": 256, "intermediate_size": 256}
    path = _gguf(tmp_path / "k", Q.Q4_K, {"attn_v": Q.Q6_K, "ffn_down": Q.Q6_K}, **wide)
    cases["gguf-q4_k"] = (path, _hf_gguf(path), False)
    return cases


def _per_part(name: str, weight: Any, config: Any) -> dict[str, np.ndarray]:
    """One process's layer weight as the checkpoint tensors it was made of (a fused layer's
    rows split into its parts), for `expected_shard`."""
    if name.endswith("qkv_proj"):
        head_dim = config.hidden_size // config.num_attention_heads
        kv = config.num_key_value_heads * head_dim
        sizes = {"q_proj": config.num_attention_heads * head_dim, "k_proj": kv, "v_proj": kv}
    elif name.endswith("gate_up_proj"):
        sizes = dict.fromkeys(("gate_proj", "up_proj"), config.intermediate_size)
    else:
        return {f"{name}.weight": weight}
    start, parts = 0, {}
    for part, size in sizes.items():
        fused = name.rpartition(".")[2]
        parts[f"{name.replace(fused, part)}.weight"] = weight[start : start + size]
        start += size
    return parts


def _expected(name: str, single: list[Any], config: Any, rank: int) -> list[Any]:
    """The slice rank `rank` must hold of one process's weight, field by field."""
    if len(single) > 1:
        return _expected_parts(name, single, config, rank)
    ((qweight, scales, offsets, perm, bits, group),) = single
    if name.endswith(ROW_PARALLEL) and scales.shape[1] == 1:  # channelwise: every rank's
        width = qweight.shape[1] // TP  # columns are one group with the row's scale
        cols = slice(rank * width, (rank + 1) * width)
        return [(qweight[:, cols], scales, offsets, perm, bits, group // TP)]
    sliced = []
    for field in (qweight, scales, offsets):
        if field is None:
            sliced.append(None)
            continue
        parts = {k: torch.from_numpy(v) for k, v in _per_part(name, field, config).items()}
        shard = expected_shard(f"{name}.weight", parts, config, rank, TP)
        sliced.append(shard.to(torch.from_numpy(field).dtype).numpy())  # (padding: float zeros)
    return [(*sliced, perm, bits, group)]


def _expected_parts(name: str, single: list[Any], config: Any, rank: int) -> list[Any]:
    """A fused layer whose parts differ in format (q, k in Q4_K, v in Q6_K): `expected_shard`
    applied to the rows' numbers says which rows of each part the rank holds."""
    numbers = torch.arange(sum(p[0].shape[0] for p in single), dtype=torch.float64)[:, None]
    rows = expected_shard(f"{name}.weight", _per_part(name, numbers, config), config, rank, TP)
    rows = rows[:, 0].long()
    out, start = [], 0
    for part in single:
        end = start + part[0].shape[0]
        mine = (rows[(rows >= start) & (rows < end)] - start).numpy()
        out.append(tuple(None if t is None else t[mine] for t in part[:3]) + part[3:])
        start = end
    return out


def _assert_same(got: list[Any], want: list[Any], where: str) -> None:
    assert len(got) == len(want), where
    for got_part, want_part in zip(got, want, strict=True):
        assert got_part[4:] == want_part[4:], f"{where}: bits / group size"
        for field, a, b in zip(FIELDS, got_part[:4], want_part[:4], strict=True):
            assert (a is None) == (b is None), f"{where}: {field} present on one side only"
            if a is not None:
                assert a.dtype == b.dtype, f"{where}: {field} dtype {a.dtype} != {b.dtype}"
                assert np.array_equal(a, b), f"{where}: {field} differs from the slice"


def _assert_act_order_exact(
    where: str, got: list[Any], dense: Any, single: list[Any], single_dense: Any, hf: Any, rank: int
) -> None:
    """A row-parallel act-order layer: the rank's effective dense weight is the slice of one
    process's and of HF's (`torch.equal`), with the checkpoint's own scales and offsets."""
    name = where.rpartition(" ")[2]
    key = f"{name}.weight"
    config = hf.config
    want = expected_shard(key, {key: torch.from_numpy(single_dense)}, config, rank, TP)
    reference = dict(hf.named_parameters())[key].detach()
    assert torch.equal(torch.from_numpy(dense), want), f"{where}: dense weight != the slice"
    assert torch.equal(want, expected_shard(key, {key: reference}, config, rank, TP)), where
    ((_, scales, offsets, perm, bits, _),) = got
    assert perm is not None, f"{where}: not held in act-order"
    ((_, single_scales, single_offsets, _, single_bits, _),) = single
    assert bits == single_bits, where
    pairs = [single_scales] if offsets is None else [single_scales, single_offsets]
    known = {np.stack([p[:, j] for p in pairs]).tobytes() for j in range(pairs[0].shape[1])}
    mine = [scales] if offsets is None else [scales, offsets]
    for j in range(scales.shape[1]):  # each kernel group: one checkpoint group's scales
        assert np.stack([p[:, j] for p in mine]).tobytes() in known, f"{where}: group {j}"
    width = dense.shape[1]  # every input column once; the rest read the zero at `width`
    assert sorted(perm[perm < width].tolist()) == list(range(width)), where


def test_ranks_hold_their_slice_of_the_checkpoints_integers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOKENWISE_GGUF_CACHE", str(tmp_path / "tokenizers"))
    cases = _cases(tmp_path)
    reports = run_ranks(worker.run_rank, TP, {c: v[0] for c, v in cases.items()}, deadline_s=240.0)
    for case, (path, hf, act_order) in cases.items():
        single = worker.load(path, 1)
        single_packed = worker.packed_layers(single)
        single_dense_all = worker.row_parallel_dense(single)
        if case == "gguf-q4_k":  # q, k in Q4_K beside v in Q6_K: one weight per part
            assert len(single_packed["model.layers.0.self_attn.qkv_proj"]) == 3
        config = hf.config
        _, single_tokens = worker.logits_and_greedy(single)
        hf_logits, hf_tokens = _hf_logits_and_greedy(hf)
        assert single_tokens == hf_tokens, case
        for rank in range(TP):
            report = reports[rank][case]
            assert report["packed"].keys() == single_packed.keys(), case
            for name, got in report["packed"].items():
                where = f"{case} rank {rank} {name}"
                if act_order and name.endswith(ROW_PARALLEL):
                    dense, single_dense = report["dense"].get(name), single_dense_all.get(name)
                    assert dense is not None and single_dense is not None, where
                    args = (got, dense, single_packed[name], single_dense, hf, rank)
                    _assert_act_order_exact(where, *args)
                else:
                    _assert_same(got, _expected(name, single_packed[name], config, rank), where)
            logits = torch.from_numpy(report["logits"])
            torch.testing.assert_close(logits, hf_logits, atol=ATOL, rtol=0, msg=case)
            assert report["tokens"] == hf_tokens == single_tokens, case


def _layer(**layout: Any) -> Any:
    from types import SimpleNamespace

    return SimpleNamespace(tp_size=TP, **layout)


@pytest.mark.parametrize(("bits", "group"), [(4, 32), (4, 64), (8, 16)])
def test_slices_dequantize_to_the_dense_slices(bits: int, group: int) -> None:
    """Rows of each fused part (or of one fused checkpoint tensor), group-aligned columns
    (int4: whole 16-byte blocks) and zero padding rows, checked against the dense weight's own
    slices; a part of another size than the layer's is declined."""
    from tokenwise.layers.quantization.tp_slice import rank_part, slice_rows

    w = torch.randn(12, 256, generator=torch.Generator().manual_seed(bits + group))
    record = quantize(w, bits, group, symmetric=bits == 8)
    dense = record.dequantize()
    row = _layer(source_columns=lambda: (128, 128))
    cols = rank_part("down_proj", row, None, 1, record)
    assert cols is not None and torch.equal(cols.dequantize(), dense[:, 128:])
    column = _layer(
        source_rows=lambda i: (2 * i, 2 + 2 * i), full_output_sizes=[4, 8], shard_index=int
    )
    gate, up = quantize(w[:4], bits, group), quantize(w[4:], bits, group)
    mine = rank_part("gate_up_proj", column, 1, 2, up)
    assert mine is not None and torch.equal(mine.dequantize(), up.dequantize()[2:6])
    fused = rank_part("gate_up_proj", column, None, 1, record)  # [gate | up] in one tensor
    assert fused is not None
    assert torch.equal(fused.dequantize(), torch.cat([dense[:2], dense[6:10]]))
    assert rank_part("gate_up_proj", column, 0, 2, up) is None  # 8 rows where gate has 4
    channelwise = quantize(w, bits, 256, symmetric=bits == 8)  # GPTQ's group_size=-1
    cols = rank_part("down_proj", row, None, 1, channelwise)
    assert cols is not None and cols.group_size == 128
    assert torch.equal(cols.dequantize(), channelwise.dequantize()[:, 128:])
    vocab = _layer(vocab_start=9, vocab_end=12, weight=torch.empty(6, 256))
    table = rank_part("embed_tokens", vocab, None, 1, record)
    assert table is not None
    assert torch.equal(table.dequantize(), torch.cat([dense[9:], torch.zeros(3, 256)]))
    with pytest.raises(ValueError, match="rows 4..8 are not within the record's 4"):
        slice_rows(gate, 4, 4)  # never a shape its tensors lack


def test_slices_that_are_not_exact_are_declined_and_logged(caplog: Any) -> None:
    """Columns off the groups: None (the caller quantizes the dense slice), with the layer and
    the reason in the log. Act-order columns at the same place are no longer declined
    (`act_order_slice`): they come back exact, and nothing is logged for them."""
    from tokenwise.layers.quantization.tp_slice import rank_part

    record = quantize(torch.randn(8, 128), 4, 64, symmetric=False)
    permuted = quantize(torch.randn(8, 128), 4, 32, symmetric=False)
    permuted.input_perm = torch.randperm(128, generator=torch.Generator().manual_seed(0))
    quarter = _layer(source_columns=lambda: (32, 32))
    with caplog.at_level("INFO"):
        mine = rank_part("l0.o_proj", quarter, None, 1, permuted)
        assert rank_part("l1.o_proj", quarter, None, 1, record) is None
    assert mine is not None and torch.equal(mine.dequantize(), permuted.dequantize()[:, 32:64])
    assert "l0.o_proj" not in caplog.text
    assert "l1.o_proj" in caplog.text and "columns 32..64" in caplog.text
