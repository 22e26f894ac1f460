"""Dual-batch overlap's ping-pong runner, without processes: turns, failures, bounds, delay."""

from __future__ import annotations

import argparse
import threading
import time
from typing import Any

import pytest

from tokenwise.distributed.dbo import (
    DualBatchRunner,
    collective_delay_s,
    dbo_current_ubatch,
    dbo_timeout_s,
    dbo_yield,
    wait_collective,
)
from tokenwise.entrypoints.engine_args import add_engine_args, engine_kwargs
from tokenwise.entrypoints.llm import build_engine_config
from tokenwise.runner.ubatch_runner import dbo_sequential


def _segments(log: list[tuple[int, int]], active: list[int], n: int) -> Any:
    """A micro-batch body of `n` segments separated by yield points; checks exclusivity."""

    def body() -> int:
        me = dbo_current_ubatch()
        assert me is not None
        for seg in range(n):
            active[0] += 1
            assert active[0] == 1, "two micro-batches ran at once"
            log.append((me, seg))
            time.sleep(0.001)  # gives a racing thread every chance to show up
            active[0] -= 1
            dbo_yield(f"seg{seg}")
        return me * 100 + n

    return body


def test_micro_batches_alternate_strictly_and_finish_alone() -> None:
    log: list[tuple[int, int]] = []
    active = [0]
    runner = DualBatchRunner(2, rank=3, timeout_s=10)
    # Micro-batch 1 has two more segments: once 0 is done, 1 keeps the turn.
    results = runner.run([_segments(log, active, 3), _segments(log, active, 5)])
    assert results == [3, 105]
    assert log == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2), (1, 3), (1, 4)]
    assert dbo_current_ubatch() is None  # the caller's thread is no micro-batch


def test_an_exception_in_one_micro_batch_is_the_steps_error_and_unparks_the_other() -> None:
    reached: list[int] = []

    def ubatch0() -> None:
        dbo_yield()  # parks while micro-batch 1 fails
        reached.append(0)  # must never run: the step is over

    def ubatch1() -> None:
        raise KeyError("boom")

    started = time.monotonic()
    with pytest.raises(KeyError, match="boom") as info:
        DualBatchRunner(2, rank=1, timeout_s=30).run([ubatch0, ubatch1])
    assert time.monotonic() - started < 5  # well below the 30 s bound: nothing waited it out
    assert any("micro-batch 1 on DP rank 1" in note for note in info.value.__notes__)
    assert reached == []
    assert not [t for t in threading.enumerate() if t.name.startswith("tokenwise-ubatch")]


def test_a_failure_before_the_first_yield_never_starts_the_other() -> None:
    ran: list[int] = []
    with pytest.raises(ValueError, match="first"):
        DualBatchRunner(2, timeout_s=30).run(
            [lambda: (_ for _ in ()).throw(ValueError("first")), lambda: ran.append(1)]
        )
    assert ran == []


def test_a_turn_held_too_long_is_a_timeout_naming_the_waiting_micro_batch() -> None:
    # 0.6 s: past micro-batch 1's 0.3 s bound, within the step's 3 x 0.3 s one.
    with pytest.raises(TimeoutError, match=r"micro-batch 1 on DP rank 0 waited more than 0.3s"):
        DualBatchRunner(2, timeout_s=0.3).run([lambda: time.sleep(0.6), lambda: None])


def test_a_segment_that_never_ends_is_abandoned_with_a_timeout() -> None:
    with pytest.raises(TimeoutError, match=r"micro-batch 0 on DP rank 0 did not finish"):
        DualBatchRunner(1, timeout_s=0.1).run([lambda: time.sleep(1.0)])


class _Work:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.timeout: Any = None

    def wait(self, timeout: Any = None) -> bool:
        self.timeout = timeout
        if self.fail:
            raise RuntimeError("Timed out waiting 1000ms for recv operation to complete")
        return True


def test_injected_latency_counts_from_the_issue(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENWISE_MOE_COLLECTIVE_DELAY_MS", "80")
    assert collective_delay_s() == pytest.approx(0.08)
    work = _Work()
    start = time.perf_counter()
    wait_collective(work, start, "MoE dispatch")
    assert time.perf_counter() - start >= 0.08
    assert work.timeout is not None and work.timeout.total_seconds() > 0  # always bounded
    start = time.perf_counter()
    wait_collective(_Work(), start - 1.0, "MoE dispatch")  # issued 1 s ago: no sleep left
    assert time.perf_counter() - start < 0.05


def test_a_collective_that_never_completes_names_itself() -> None:
    with pytest.raises(
        TimeoutError, match="MoE combine of the step failed or did not complete within"
    ):
        wait_collective(_Work(fail=True), time.perf_counter(), "MoE combine")


@pytest.mark.parametrize(
    ("name", "bad", "read"),
    [
        ("TOKENWISE_MOE_COLLECTIVE_DELAY_MS", "-1", collective_delay_s),
        ("TOKENWISE_MOE_COLLECTIVE_DELAY_MS", "fast", collective_delay_s),
        ("TOKENWISE_DBO_TIMEOUT_S", "0", dbo_timeout_s),
        ("TOKENWISE_DBO_SEQUENTIAL", "maybe", dbo_sequential),
    ],
)
def test_bad_settings_are_rejected_by_name(
    monkeypatch: pytest.MonkeyPatch, name: str, bad: str, read: Any
) -> None:
    monkeypatch.setenv(name, bad)
    with pytest.raises(ValueError, match=name):
        read()


def test_enable_dbo_is_an_alias_of_enable_microbatching() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args(["--enable-dbo"]))["enable_microbatching"] is True
    assert engine_kwargs(parser.parse_args([]))["enable_microbatching"] is False
    from tests.engine._fixtures import checkpoint

    config = build_engine_config(
        checkpoint("MixtralForCausalLM"), enable_dbo=True, dbo_decode_token_threshold=7
    )
    assert config.parallel.enable_microbatching
    assert config.parallel.microbatching_decode_token_threshold == 7
    with pytest.raises(ValueError, match="dbo_prefill_token_threshold"):
        build_engine_config(checkpoint("MixtralForCausalLM"), dbo_prefill_token_threshold=0)
