"""Under tensor parallelism each rank keeps its slice of an FP8 checkpoint's own bytes and
block scales (`fp8_loading.rank_slice`), cut on the 128-wide tiles, and computes HF's logits.

One spawn of two gloo ranks loads two block-FP8 checkpoints: one whose every slice holds whole
tiles (hidden 256, 4 KV heads of 64: K/V 256 rows, 128 per rank; intermediate 512), which must
hold exactly (`torch.equal`) the rows (column-parallel) or columns (row-parallel) of what one
process holds, with the matching tile scales, and give transformers' logits on the dense
weights (fp32, 1e-4); and one with 2 KV heads (K/V 128 rows: 64 per rank would cut a tile),
which must be refused naming the layer; and the first without one layer's `weight_scale_inv`
(read lazily under TP), refused naming it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.distributed._spawn import run_ranks
from tests.engine._fixtures import hf_model
from tests.quantization import _fp8_tp_worker as worker
from tests.quantization._tp_exact_worker import TP_SIZE, load, prompt_ids
from tests.quantization.test_fp8 import _drop_scale, write_fp8

SHAPE = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4}
ROW_PARALLEL = ("o_proj", "down_proj")


def _rank_slice(name: str, weight: np.ndarray, scale: np.ndarray, rank: int, parts: list[int]):
    """The rank's rows of each fused part (column-parallel) or columns (row-parallel)."""
    if name.endswith(ROW_PARALLEL):
        width = weight.shape[1] // TP_SIZE
        cols = slice(rank * width, (rank + 1) * width)
        tiles = slice(rank * width // 128, (rank + 1) * width // 128)
        return weight[:, cols], scale[:, tiles]
    rows, tiles, start = [], [], 0
    for size in parts:
        mine = size // TP_SIZE
        rows.append(weight[start + rank * mine : start + (rank + 1) * mine])
        tiles.append(scale[(start + rank * mine) // 128 : (start + (rank + 1) * mine) // 128])
        start += size
    return np.concatenate(rows), np.concatenate(tiles)


def test_ranks_hold_exact_tile_slices_and_compute_hf_logits(
    tmp_path: Path, monkeypatch: Any
) -> None:
    (tmp_path / "whole").mkdir()
    (tmp_path / "cut").mkdir()
    whole, reference = write_fp8(
        tmp_path / "whole", "LlamaForCausalLM", {**SHAPE, "num_key_value_heads": 4}
    )
    cut, _ = write_fp8(tmp_path / "cut", "LlamaForCausalLM", {**SHAPE, "num_key_value_heads": 2})
    (tmp_path / "noscale").mkdir()
    noscale, _ = write_fp8(
        tmp_path / "noscale", "LlamaForCausalLM", {**SHAPE, "num_key_value_heads": 4}
    )
    _drop_scale(noscale)
    cases = {"whole": whole, "cut": cut, "noscale": noscale}
    reports = run_ranks(worker.run_rank, TP_SIZE, cases, deadline_s=120)
    for rank in range(TP_SIZE):
        assert "error" not in reports[rank], reports[rank].get("error")
        assert "up_proj.weight is float8 but" in reports[rank]["noscale"]["refused"]
        assert "k_proj" in reports[rank]["cut"]["refused"]
        assert "cut the checkpoint's 128-wide fp8 blocks" in reports[rank]["cut"]["refused"]
    monkeypatch.setenv("TOKENWISE_CPU_FP8_WEIGHTS", "fp8")
    single = worker.fp8_layers(load(whole, 1))
    parts = {"qkv_proj": [256, 256, 256], "gate_up_proj": [512, 512]}
    for rank in range(TP_SIZE):
        held = reports[rank]["whole"]["fp8"]
        assert held.keys() == single.keys()
        for name, ((weight, scale),) in single.items():
            sizes = parts.get(name.rpartition(".")[2], [weight.shape[0]])
            expected = _rank_slice(name, weight, scale, rank, sizes)
            ((ours_w, ours_s),) = held[name]
            assert np.array_equal(ours_w, expected[0]) and np.array_equal(ours_s, expected[1]), name
    with torch.no_grad():
        hf = hf_model(reference)(prompt_ids()[None]).logits[0]
    for rank in range(TP_SIZE):
        torch.testing.assert_close(
            torch.from_numpy(reports[rank]["whole"]["logits"]), hf, atol=1e-4, rtol=0
        )
