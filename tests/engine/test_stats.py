"""The periodic stats line: rates over the interval, and silence before the interval passes."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from tokenwise import platform
from tokenwise.engine.stats import EngineStats, StatLogger, combine_stats
from tokenwise.platform import configure_cpu_allocator


def test_stat_logger_reports_rates_over_the_interval(caplog: pytest.LogCaptureFixture) -> None:
    logger = StatLogger(log_interval_s=10.0)
    start = logger._last_time
    stats = EngineStats(
        num_running=3,
        num_waiting=2,
        kv_cache_usage=0.25,
        prefix_cache_queries=200,
        prefix_cache_hits=50,
    )
    stats.prompt_tokens_total, stats.generation_tokens_total = 500, 40
    assert logger.maybe_log(stats, now=start + 5.0) is None  # before the interval
    with caplog.at_level(logging.INFO, logger="tokenwise.engine"):
        line = logger.maybe_log(stats, now=start + 10.0)
    assert line is not None and line in caplog.text
    assert "Avg prompt throughput: 50.0 tokens/s" in line  # 500 tokens / 10 s
    assert "Avg generation throughput: 4.0 tokens/s" in line
    assert "Running: 3 reqs, Waiting: 2 reqs" in line
    assert "KV cache usage: 25.0%" in line
    assert "Prefix cache hit rate: 25.0%" in line
    # The next window counts only what happened since this report.
    stats.generation_tokens_total = 60
    line = logger.maybe_log(stats, now=start + 20.0)
    assert line is not None and "Avg generation throughput: 2.0 tokens/s" in line


def test_hit_rate_without_queries_is_zero() -> None:
    assert EngineStats().prefix_cache_hit_rate == 0.0


def fake_libc(monkeypatch: pytest.MonkeyPatch, result: int) -> list[tuple[int, int]]:
    """Stand in a libc whose `mallopt` returns `result`; returns the calls it gets."""
    calls: list[tuple[int, int]] = []

    def mallopt(param: int, value: int) -> int:
        calls.append((param, value))
        return result

    fake_ctypes = SimpleNamespace(
        CDLL=lambda path: SimpleNamespace(mallopt=mallopt),
        util=SimpleNamespace(find_library=lambda name: "libc.so.fake"),
    )
    monkeypatch.setattr(platform, "ctypes", fake_ctypes)
    monkeypatch.setattr(platform, "_configured", False)
    return calls


def test_allocator_setting_is_applied_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fake_libc(monkeypatch, result=1)
    assert configure_cpu_allocator(1 << 20) is True
    both = [(platform._M_MMAP_THRESHOLD, 1 << 20), (platform._M_TRIM_THRESHOLD, 1 << 20)]
    assert calls == both
    assert configure_cpu_allocator(1 << 30) is True
    assert calls == both  # idempotent: the second call changes nothing


def test_allocator_setting_that_fails_is_not_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fake_libc(monkeypatch, result=0)  # mallopt says no
    assert configure_cpu_allocator() is False
    assert configure_cpu_allocator() is False
    assert len(calls) == 2  # tried again (one call each: the first failure short-circuits)


def test_lora_adapters_of_data_parallel_ranks_are_one_sorted_list() -> None:
    ranks = [
        EngineStats(running_lora_adapters=["b", "a"], waiting_lora_adapters=["c"]),
        EngineStats(running_lora_adapters=["c", "a"]),
    ]
    total = combine_stats(ranks)
    assert total.running_lora_adapters == ["a", "b", "c"]
    assert total.waiting_lora_adapters == ["c"]
