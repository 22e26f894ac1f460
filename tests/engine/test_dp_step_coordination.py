"""One DP coordination per step, and the forward context never coordinates on its own.

Under data parallelism an MoE model's forward pass needs every rank's token count. The runner
obtains them once per step (one small all-reduce, `coordinate_step_across_dp`) and hands them
to `set_forward_context`; a step split into two micro-batches derives both micro-batches'
counts from that one result, and an idle rank's dummy batch joins the same single collective.
Two spawned gloo ranks (tests/engine/_dp_step_worker.py) step a tiny Mixtral engine each and
count the collectives around every step.
"""

from __future__ import annotations

from tests.distributed._spawn import run_ranks
from tests.engine._dp_step_worker import run_rank


def test_each_step_coordinates_once_including_micro_batches_and_dummy_batches() -> None:
    reports = run_ranks(run_rank, 2, deadline_s=400.0)
    steps = {rank: report["steps"] for rank, report in reports.items()}
    assert len(steps[0]) == len(steps[1])  # lock-step: the same number of forward steps
    for rank, report in reports.items():
        assert [n for _, n, _ in steps[rank]] == [1] * len(steps[rank]), steps[rank]
        assert report["outside_steps"] == 0
        # set_forward_context was always handed its counts: its own collective never ran.
        assert report["fallback_coordinations"] == 0
    kinds = [(a[0], b[0]) for a, b in zip(steps[0], steps[1], strict=True)]
    assert ("step", "dummy") in kinds  # rank 1 ran out of work first and kept stepping
    ubatched = [(a[2], b[2]) for a, b in zip(steps[0], steps[1], strict=True)]
    assert (1, 1) in ubatched  # some step was split, on both ranks alike
    assert all(a == b for a, b in ubatched)
    # Both ranks' forward contexts received the same count vectors in the same order: two per
    # micro-batched step (first micro-batch, second), one per other step.
    seen0, seen1 = reports[0]["dp_counts_seen"], reports[1]["dp_counts_seen"]
    num_passes = sum(1 + u for _, _, u in steps[0])
    assert seen0 == seen1
    assert len(seen0) == num_passes
