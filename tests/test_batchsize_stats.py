"""Batch-size forward-time statistics (forward-context.md §1, "Batch-size forward-time ...").

Most tests use a private `BatchSizeForwardStats` with an explicit interval and the `now=`
parameter, so report timing is deterministic. The module-level store is only touched through
`reset_batchsize_forward_time_stats`, and restored afterwards.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest

from tokenwise.batchsize_stats import (
    ENV_INTERVAL,
    REPORT_PREFIX,
    BatchSizeForwardStats,
    batchsize_forward_stats,
    get_batchsize_forward_time_samples,
    get_batchsize_forward_time_stats,
    reset_batchsize_forward_time_stats,
)

LOGGER = "tokenwise.forward_context"
SPEC_PREFIX = "Batchsize forward time stats (batchsize, count, median_time(ms)): "


@pytest.fixture
def restore_global(monkeypatch: pytest.MonkeyPatch) -> Any:
    original = batchsize_forward_stats.interval_s
    yield monkeypatch
    monkeypatch.undo()
    reset_batchsize_forward_time_stats(interval_s=original)


def _fill(stats: BatchSizeForwardStats, samples: dict[int, list[float]], now: float) -> None:
    """Record every sample at one fixed time, sizes in the dict's order (= first-seen order)."""
    for size, times in samples.items():
        for t in times:
            stats.record(size, t, now=now)


def test_env_var_name_and_prefix_match_the_spec() -> None:
    assert ENV_INTERVAL == "TOKENWISE_LOG_BATCHSIZE_INTERVAL"
    assert REPORT_PREFIX == SPEC_PREFIX


@pytest.mark.parametrize("value", [None, "-1"])
def test_disabled_by_default_records_nothing(
    restore_global: pytest.MonkeyPatch, value: str | None
) -> None:
    if value is None:
        restore_global.delenv(ENV_INTERVAL, raising=False)
    else:
        restore_global.setenv(ENV_INTERVAL, value)
    reset_batchsize_forward_time_stats()
    assert not batchsize_forward_stats.enabled
    assert batchsize_forward_stats.record(8, 1.0, now=1e9) is None
    assert batchsize_forward_stats.record(8, 2.0, now=2e9) is None
    assert get_batchsize_forward_time_samples() == {}
    assert get_batchsize_forward_time_stats() == []


def test_env_var_zero_enables(restore_global: pytest.MonkeyPatch) -> None:
    restore_global.setenv(ENV_INTERVAL, "0")
    reset_batchsize_forward_time_stats()
    assert batchsize_forward_stats.enabled
    assert batchsize_forward_stats.interval_s == 0.0


def test_spec_example_table() -> None:
    stats = BatchSizeForwardStats(interval_s=1e9)
    stats.reset(interval_s=1e9, now=0.0)
    _fill(stats, {8: [1, 2, 4, 3], 16: [5, 7], 32: [9]}, now=1.0)
    # 8: sorted [1, 2, 3, 4] -> (2 + 3) / 2 = 2.5; 16: (5 + 7) / 2 = 6.0; 32 has one sample.
    assert stats.table() == [(8, 4, 2.5), (16, 2, 6.0)]


def test_median_rounding_and_odd_count() -> None:
    stats = BatchSizeForwardStats(interval_s=1e9)
    stats.reset(interval_s=1e9, now=0.0)
    _fill(stats, {4: [1.0, 1.004, 1.006], 2: [0.1234, 0.5]}, now=1.0)
    # 4: odd count -> middle value 1.004 -> 1.0; 2: (0.1234 + 0.5) / 2 = 0.3117 -> 0.31.
    assert stats.table() == [(4, 3, 1.0), (2, 2, 0.31)]


def test_single_sample_sizes_are_omitted() -> None:
    stats = BatchSizeForwardStats(interval_s=1e9)
    stats.reset(interval_s=1e9, now=0.0)
    _fill(stats, {1: [3.0], 2: [4.0], 3: [5.0]}, now=1.0)
    assert stats.table() == []


def test_ties_in_count_keep_first_seen_order() -> None:
    stats = BatchSizeForwardStats(interval_s=1e9)
    stats.reset(interval_s=1e9, now=0.0)
    # Seen first: 64, then 2, then 16, then 8; counts 2, 3, 2, 2.
    for size, t in [
        (64, 1.0),
        (2, 1.0),
        (16, 1.0),
        (8, 1.0),
        (2, 1.0),
        (8, 3.0),
        (16, 3.0),
        (64, 3.0),
        (2, 1.0),
    ]:
        stats.record(size, t, now=1.0)
    assert stats.table() == [(2, 3, 1.0), (64, 2, 2.0), (16, 2, 2.0), (8, 2, 2.0)]


def test_report_only_strictly_after_the_interval(caplog: pytest.LogCaptureFixture) -> None:
    stats = BatchSizeForwardStats(interval_s=10.0)
    stats.reset(interval_s=10.0, now=100.0)
    caplog.set_level(logging.INFO, logger=LOGGER)
    assert stats.record(8, 1.0, now=105.0) is None
    assert stats.record(8, 3.0, now=110.0) is None  # exactly the interval: not more than it
    line = stats.record(8, 5.0, now=110.001)
    assert line == SPEC_PREFIX + "[(8, 3, 3.0)]"
    messages = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert messages == [line]
    assert all(r.levelno == logging.INFO for r in caplog.records if r.name == LOGGER)
    # The timer restarted at 110.001: nothing until more than 10 s after that.
    assert stats.record(8, 5.0, now=120.001) is None
    assert stats.record(8, 5.0, now=120.002) is not None


def test_timer_resets_even_when_nothing_is_listed(caplog: pytest.LogCaptureFixture) -> None:
    stats = BatchSizeForwardStats(interval_s=10.0)
    stats.reset(interval_s=10.0, now=0.0)
    caplog.set_level(logging.INFO, logger=LOGGER)
    # Past the interval, but size 8 has one sample: no line, yet the timer restarts at 11.
    assert stats.record(8, 1.0, now=11.0) is None
    assert not [r for r in caplog.records if r.name == LOGGER]
    # 15 is more than 10 after the start (0) but not after the reset (11): still no report.
    assert stats.record(8, 2.0, now=15.0) is None
    assert stats.record(8, 2.0, now=21.0) is None  # exactly 10 after 11
    line = stats.record(8, 2.0, now=21.5)
    assert line is not None and line.startswith(SPEC_PREFIX)
    assert line == SPEC_PREFIX + "[(8, 4, 2.0)]"


def test_samples_are_cumulative_across_reports() -> None:
    stats = BatchSizeForwardStats(interval_s=1.0)
    stats.reset(interval_s=1.0, now=0.0)
    stats.record(4, 1.0, now=0.5)
    assert stats.record(4, 3.0, now=2.0) == SPEC_PREFIX + "[(4, 2, 2.0)]"
    assert stats.record(4, 5.0, now=4.0) == SPEC_PREFIX + "[(4, 3, 3.0)]"


def test_reset_clears_everything() -> None:
    stats = BatchSizeForwardStats(interval_s=1e9)
    stats.reset(interval_s=1e9, now=0.0)
    _fill(stats, {8: [1, 2]}, now=1.0)
    assert stats.table() == [(8, 2, 1.5)]
    stats.reset(interval_s=1e9, now=2.0)
    assert stats.table() == []


def test_global_reset_clears_samples(restore_global: pytest.MonkeyPatch) -> None:
    reset_batchsize_forward_time_stats(interval_s=1e9)
    batchsize_forward_stats.record(4, 1.0)
    batchsize_forward_stats.record(4, 2.0)
    assert get_batchsize_forward_time_stats() == [(4, 2, 1.5)]
    assert get_batchsize_forward_time_samples() == {4: [1.0, 2.0]}
    reset_batchsize_forward_time_stats(interval_s=1e9)
    assert get_batchsize_forward_time_stats() == []
    assert get_batchsize_forward_time_samples() == {}


def test_samples_copy_is_independent(restore_global: pytest.MonkeyPatch) -> None:
    reset_batchsize_forward_time_stats(interval_s=1e9)
    batchsize_forward_stats.record(4, 1.0)
    copy = get_batchsize_forward_time_samples()
    copy[4].append(99.0)
    assert get_batchsize_forward_time_samples() == {4: [1.0]}


def test_concurrent_records_lose_no_sample() -> None:
    stats = BatchSizeForwardStats(interval_s=1e9)
    stats.reset(interval_s=1e9, now=0.0)
    threads_n, per_thread = 8, 500
    barrier = threading.Barrier(threads_n, timeout=10)

    def worker(i: int) -> None:
        barrier.wait()
        for j in range(per_thread):
            stats.record(1 + (i + j) % 3, 1.0, now=1.0)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(threads_n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sum(count for _, count, _ in stats.table()) == threads_n * per_thread == 4000


def test_invalid_env_value_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_INTERVAL, "often")
    with pytest.raises(ValueError, match=ENV_INTERVAL):
        BatchSizeForwardStats()
