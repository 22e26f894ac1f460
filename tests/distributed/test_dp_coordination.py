"""DP batch coordination: the pure decision rule, DP size 1, and two real gloo ranks."""

from __future__ import annotations

import multiprocessing as mp
import queue as queue_mod
import socket
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.distributed import _dp_worker
from tokenwise.config import CUDAGraphMode, ParallelConfig
from tokenwise.distributed import (
    coordinate_batch_across_dp,
    decide_from_dp_matrix,
    is_dp_group_initialized,
)

DEADLINE_S = 90.0


def _matrix(unpadded: list[int], padded: list[int], wants: list[int], allows: list[int],
            modes: list[int]) -> torch.Tensor:  # fmt: skip
    return torch.tensor([unpadded, padded, wants, allows, modes], dtype=torch.int32)


def test_dp_size_one_runs_no_collective(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("no collective may run with DP size 1")

    monkeypatch.setattr(dist, "all_reduce", forbidden)
    assert not dist.is_initialized() and not is_dp_group_initialized()
    cfg = ParallelConfig(enable_microbatching=True, microbatching_prefill_token_threshold=1)
    assert coordinate_batch_across_dp(100, True, True, cfg) == (False, None, 0)
    assert coordinate_batch_across_dp(7, False, True, cfg, cudagraph_mode=2) == (False, None, 2)
    out = coordinate_batch_across_dp(7, False, False, cfg, cudagraph_mode=CUDAGraphMode.PIECEWISE)
    assert out == (False, None, 1)


def test_dp_without_group_says_how_to_initialise() -> None:
    cfg = ParallelConfig(data_parallel_size=2, data_parallel_rank=1)
    with pytest.raises(RuntimeError, match="init_dp_group"):
        coordinate_batch_across_dp(4, False, False, cfg)


def test_inconsistent_inputs_are_rejected_before_any_collective() -> None:
    cfg = ParallelConfig(data_parallel_size=2)
    with pytest.raises(ValueError, match="num_tokens_padded"):
        coordinate_batch_across_dp(9, False, True, cfg, num_tokens_padded=8)
    with pytest.raises(ValueError, match="sums to 5"):
        coordinate_batch_across_dp(6, False, True, cfg, num_scheduled_tokens_per_request=[2, 3])
    with pytest.raises(ValueError, match="cudagraph_mode"):
        coordinate_batch_across_dp(
            6, False, True, cfg, cudagraph_mode=CUDAGraphMode.FULL_DECODE_ONLY
        )


def test_decision_rule() -> None:
    # All want micro-batching, all allow padding: pad to the max padded count (12).
    ubatch, padded, mode = decide_from_dp_matrix(
        _matrix([7, 10, 9], [8, 12, 9], [1, 1, 1], [1, 1, 1], [2, 1, 2])
    )
    assert (ubatch, padded.tolist(), mode) == (True, [12, 12, 12], 1)
    # One rank forbids padding and nobody micro-batches: every rank keeps its own padded count.
    ubatch, padded, _ = decide_from_dp_matrix(
        _matrix([7, 10, 9], [8, 12, 9], [1, 0, 1], [1, 0, 1], [0, 0, 0])
    )
    assert (ubatch, padded.tolist()) == (False, [8, 12, 9])
    # Micro-batching forces padding even though no rank allows it.
    ubatch, padded, _ = decide_from_dp_matrix(_matrix([7, 10], [7, 10], [1, 1], [0, 0], [0, 0]))
    assert (ubatch, padded.tolist()) == (True, [10, 10])
    # Rank 0 has 5 real tokens; split of the padded 10 is at 5 -> its second half is padding.
    ubatch, padded, _ = decide_from_dp_matrix(_matrix([5, 10], [5, 10], [1, 1], [0, 0], [0, 0]))
    assert (ubatch, padded.tolist()) == (False, [5, 10])


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_two_ranks() -> dict[int, dict[str, Any]]:
    ctx = mp.get_context("spawn")
    results: Any = ctx.Queue()
    ports = (_free_port(), _free_port())
    procs = [
        ctx.Process(target=_dp_worker.run_rank, args=(r, *ports, results), daemon=True)
        for r in range(2)
    ]
    for p in procs:
        p.start()
    got: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + DEADLINE_S
    try:
        while len(got) < 2:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                pytest.fail(f"DP workers timed out after {DEADLINE_S}s; got so far: {got}")
            try:
                rank, out = results.get(timeout=min(remaining, 1.0))
                got[rank] = out
            except queue_mod.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    pytest.fail(f"DP worker exited with {dead[0].exitcode}; got so far: {got}")
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    for rank, out in got.items():
        assert "error" not in out, f"rank {rank} failed:\n{out['error']}"
    return got


# Expected (should_ubatch, num_tokens_after_padding, synced graph mode), worked out by hand.
EXPECTED = {
    "pad_both": (False, [9, 9], 1),
    "pad_one_forbids": (False, [5, 9], 1),
    "own_padded_sizes_no_dp_padding": (False, [8, 16], 0),
    "own_padded_sizes_dp_padding": (False, [16, 16], 0),
    "ubatch_both": (True, [30, 30], 0),
    "ubatch_only_one_allows": (False, [20, 30], 0),
    "ubatch_one_below_threshold": (False, [30, 30], 0),
    "ubatch_second_half_empty": (False, [12, 12], 0),
    "ubatch_second_half_real": (True, [12, 12], 0),
    "graph_mode_enum": (False, [1, 1], 1),
    "graph_mode_none_wins": (False, [1, 1], 0),
}


def test_two_gloo_ranks_decide_alike() -> None:
    got = _run_two_ranks()
    r0, r1 = got[0], got[1]

    assert r0["scenarios"] == r1["scenarios"]
    assert set(r0["scenarios"]) == set(EXPECTED)
    for name, expected in EXPECTED.items():
        assert tuple(r0["scenarios"][name]) == expected, name

    for out in (r0, r1):
        assert out["reinit_error"] is not None and "destroy_dp_group" in out["reinit_error"]
        assert out["moe"] == (list(_dp_worker.MOE_TOKENS), max(_dp_worker.MOE_TOKENS))
        assert out["calls_after_moe"] == out["calls_after_scenarios"] + 1
        assert out["destroyed"] and out["default_group_kept"]
        assert tuple(out["subgroup_scenario"]) == EXPECTED["pad_both"]
    assert r0["dense_dp_metadata"] is None
    assert r0["calls_after_dense"] == r0["calls_after_moe"]
    assert "dense_dp_metadata" not in r1
