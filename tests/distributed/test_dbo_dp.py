"""Dual-batch overlap at DP=2 with expert parallelism over gloo: same results, real overlap.

One spawn of two ranks serves the whole module (`_dbo_worker.py`): each rank runs the same
greedy requests without micro-batches, with sequential micro-batches and with DBO (also with
the MoE exchange in chunks of 3 tokens per rank, so several yields per layer), and ends
with a DBO step that fails inside micro-batch 1 of rank 1. The steps split are prefills
(rank 0's cut falls inside a request) and decodes.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.distributed._dbo_worker import MAX_TOKENS, run_rank
from tests.distributed._spawn import run_ranks
from tests.engine._fixtures import checkpoint, hf_greedy


@pytest.fixture(scope="module")
def reports() -> tuple[str, dict[int, Any]]:
    path = checkpoint("MixtralForCausalLM")
    return path, run_ranks(run_rank, 2, path, deadline_s=240.0)


def test_dbo_gives_the_unsplit_logits_and_hf_tokens(reports: tuple[str, dict[int, Any]]) -> None:
    path, by_rank = reports
    for rank, report in by_rank.items():
        hf = [hf_greedy(path, p, MAX_TOKENS) for p in report["prompts"]]
        assert report["unsplit"]["tokens"] == hf, rank
        for mode in ("sequential", "dbo", "dbo_chunked"):
            assert report[mode]["tokens"] == hf, (rank, mode)
            assert report[mode]["max_logit_diff"] <= 1e-5, (rank, mode)
            kinds = {decode for _, decode in report[mode]["split_steps"]}
            assert kinds == {False, True}, (rank, mode, report[mode]["split_steps"])
        assert report["unsplit"]["split_steps"] == []


def test_the_micro_batches_interleave(reports: tuple[str, dict[int, Any]]) -> None:
    _, by_rank = reports
    for rank, report in by_rank.items():
        traces = report["dbo_traces"]
        num_split = len(report["dbo"]["split_steps"]) + len(report["dbo_chunked"]["split_steps"])
        assert len(traces) == num_split, rank
        for events in traces:
            index = {(u, kind): events.index((u, kind, d)) for u, kind, d in reversed(events)}
            # Micro-batch 1 computed (and issued its own dispatch) after micro-batch 0 issued
            # its dispatch and before micro-batch 0 waited for it: the exchange overlapped.
            assert index[(0, "issue")] < index[(1, "start")] < index[(0, "wait")], events
            assert index[(1, "issue")] < index[(0, "wait")], events
            # Every collective of micro-batch 0 that micro-batch 1 outlived had 1's work
            # between its issue and its wait.
            for i, (u, kind, what) in enumerate(events):
                if (u, kind) == (0, "issue") and (1, "done") not in events[:i]:
                    wait = events.index((0, "wait", f"MoE {what}"), i)
                    assert any(e[0] == 1 for e in events[i:wait]), (i, events)


def test_a_failing_micro_batch_fails_the_step_on_every_rank_without_hanging(
    reports: tuple[str, dict[int, Any]],
) -> None:
    _, by_rank = reports
    failed, waiting = by_rank[1]["failure"], by_rank[0]["failure"]
    # Rank 1: the micro-batch's own error, named, at once.
    assert failed is not None and "injected expert failure" in failed["message"]
    assert any("micro-batch 1 on DP rank 1" in n for n in failed["notes"])
    assert failed["seconds"] < 5
    # Rank 0: its partner rank stopped issuing collectives (and exits); the collective's
    # wait fails (peer gone, or its 5 s bound) with an error naming this rank, not a hang.
    assert waiting is not None, "rank 0's step completed although rank 1 failed mid-step"
    assert "on DP rank 0" in waiting["message"] + " ".join(waiting["notes"]), waiting
    assert waiting["seconds"] < 15
    for report in by_rank.values():
        assert report["failure"]["threads_left"] == []
