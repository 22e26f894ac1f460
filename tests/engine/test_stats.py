"""The periodic stats line: rates over the interval, and silence before the interval passes."""

from __future__ import annotations

import logging

import pytest

from tokenwise.engine.stats import EngineStats, StatLogger
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


def test_allocator_setting_is_idempotent() -> None:
    first = configure_cpu_allocator()
    assert configure_cpu_allocator() == first
