"""A tensor-parallel worker (or pipeline stage) that dies or never arrives while the engine starts ends start-up
within seconds (never the collectives' minutes), with an error naming the worker (rank, pid,
exit code), and leaves no process or group behind. The engine spawns the worker entries of
`_startup_workers` in place of the real one; everything else is the ordinary `LLM` start-up.
(A worker that dies while the engine serves is `tests/engine/test_tensor_parallel.py`'s.)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

import tokenwise.executor.executor as executor_module
from tests.distributed import _startup_workers as entries
from tests.distributed._leftovers import assert_nothing_left, child_processes
from tests.engine._fixtures import checkpoint
from tokenwise import LLM
from tokenwise.distributed.rendezvous import (
    ENV_WORKER_START_TIMEOUT,
    WorkerLostError,
    worker_start_timeout_s,
)

BOUND_S = 60.0  # what the engine promises; each case below takes a few seconds


def _start_with(monkeypatch: pytest.MonkeyPatch, entry: Callable[..., None]) -> tuple[float, str]:
    """Start a TP=2 engine whose worker runs `entry`: the seconds until it failed, and why."""
    monkeypatch.setattr(executor_module, "run_tp_worker", entry)
    started = time.monotonic()
    with pytest.raises(WorkerLostError) as info:
        LLM(checkpoint(), dtype="float32", tensor_parallel_size=2, kv_cache_memory=2**20)
    return time.monotonic() - started, str(info.value)


@pytest.mark.timeout(120, method="thread")
def test_worker_dead_before_the_rendezvous_is_named_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = child_processes()
    elapsed, message = _start_with(monkeypatch, entries.exit_at_once)
    assert "tensor-parallel worker 1 (pid " in message
    assert f"exited with code {entries.EXIT_AT_ONCE_CODE} before joining" in message
    assert "if __name__ == '__main__':" in message  # the usual cause, said
    assert elapsed < BOUND_S
    assert_nothing_left(before, "a start-up whose worker died")


@pytest.mark.timeout(120, method="thread")
def test_worker_that_never_arrives_is_named_at_the_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ENV_WORKER_START_TIMEOUT, "3")
    before = child_processes()
    elapsed, message = _start_with(monkeypatch, entries.never_arrive)
    assert "tensor-parallel worker 1 (pid " in message
    assert "did not reach the rendezvous within 3 s" in message
    assert 3 <= elapsed < BOUND_S
    assert_nothing_left(before, "a start-up whose worker never arrived")  # it was killed


@pytest.mark.timeout(120, method="thread")
def test_worker_dead_after_joining_is_named_while_sizing_the_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = child_processes()
    elapsed, message = _start_with(monkeypatch, entries.exit_after_joining)
    assert "tensor-parallel worker 1 (pid " in message
    assert f"exited with code {entries.EXIT_AFTER_JOINING_CODE}" in message
    assert elapsed < BOUND_S
    assert_nothing_left(before, "a start-up whose worker died after joining")


@pytest.mark.timeout(120, method="thread")
def test_pipeline_stage_dead_before_the_rendezvous_is_named_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stages start through the same rendezvous as TP workers."""
    monkeypatch.setattr(executor_module, "run_pp_worker", entries.exit_at_once)
    before = child_processes()
    started = time.monotonic()
    path = checkpoint("LlamaForCausalLM", num_hidden_layers=4)
    with pytest.raises(WorkerLostError, match=r"pipeline stage 1 \(pid \d+\) exited with code 3"):
        LLM(path, dtype="float32", pipeline_parallel_size=2, kv_cache_memory=2**20)
    assert time.monotonic() - started < BOUND_S
    assert_nothing_left(before, "a pipeline start-up whose stage died")


@pytest.mark.parametrize("value", ["0", "-1", "soon"])
def test_bad_start_timeout_is_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, value: Any
) -> None:
    monkeypatch.setenv(ENV_WORKER_START_TIMEOUT, value)
    with pytest.raises(ValueError, match=f"{ENV_WORKER_START_TIMEOUT} must be a number"):
        worker_start_timeout_s()
