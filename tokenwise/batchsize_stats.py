"""Forward time per batch size, for finding which batch sizes are slow.

Enabled by `TOKENWISE_LOG_BATCHSIZE_INTERVAL` (seconds; negative = off, the default). Each timed
forward pass appends its duration (ms) under its token count; when more than the interval has
passed since the last report, one INFO line lists (batch size, count, median ms) for every size
seen more than once, most frequent first. Samples accumulate for the life of the process (the
report is cumulative); only the report timer resets. A lock makes concurrent forwards safe, and
`get_batchsize_forward_time_stats()` exposes the same table as data (for `/metrics`).
"""

from __future__ import annotations

import logging
import statistics
import threading
import time

from tokenwise import envs

logger = logging.getLogger("tokenwise.forward_context")

ENV_INTERVAL = "TOKENWISE_LOG_BATCHSIZE_INTERVAL"
REPORT_PREFIX = "Batchsize forward time stats (batchsize, count, median_time(ms)): "


def _interval_from_env() -> float:
    raw = envs.get(ENV_INTERVAL)
    try:
        return float(raw)
    except ValueError as exc:
        raise ValueError(f"{ENV_INTERVAL} must be a number of seconds, got {raw!r}") from exc


class BatchSizeForwardStats:
    """Thread-safe store of forward durations keyed by batch size (number of tokens)."""

    def __init__(self, interval_s: float | None = None) -> None:
        self._lock = threading.Lock()
        self._times: dict[int, list[float]] = {}
        self.interval_s = _interval_from_env() if interval_s is None else interval_s
        self._last_report = time.monotonic()

    @property
    def enabled(self) -> bool:
        return self.interval_s >= 0

    def record(self, num_tokens: int, duration_ms: float, now: float | None = None) -> str | None:
        """Add one sample; returns the report line when one was logged (for tests).

        A disabled store (negative interval) records nothing: otherwise every call would pass
        the `elapsed > interval` test and log a report.
        """
        if not self.enabled:
            return None
        now = time.monotonic() if now is None else now
        with self._lock:
            self._times.setdefault(num_tokens, []).append(duration_ms)
            if now - self._last_report <= self.interval_s:
                return None
            self._last_report = now
            table = self._table_locked()
        if not table:
            return None
        line = REPORT_PREFIX + str(table)
        logger.info(line)
        return line

    def table(self) -> list[tuple[int, int, float]]:
        with self._lock:
            return self._table_locked()

    def _table_locked(self) -> list[tuple[int, int, float]]:
        rows = [
            (size, len(times), round(statistics.median(times), 2))
            for size, times in self._times.items()
            if len(times) > 1
        ]
        # sorted() is stable, so equal counts keep first-seen (dict insertion) order.
        return sorted(rows, key=lambda row: row[1], reverse=True)

    def reset(self, interval_s: float | None = None, now: float | None = None) -> None:
        with self._lock:
            self._times.clear()
            self.interval_s = _interval_from_env() if interval_s is None else interval_s
            self._last_report = time.monotonic() if now is None else now


batchsize_forward_stats = BatchSizeForwardStats()


def get_batchsize_forward_time_stats() -> list[tuple[int, int, float]]:
    """(batch size, count, median ms) for every size with more than one sample."""
    return batchsize_forward_stats.table()


def get_batchsize_forward_time_samples() -> dict[int, list[float]]:
    """A copy of every recorded sample, for metrics and plots."""
    with batchsize_forward_stats._lock:
        return {size: list(times) for size, times in batchsize_forward_stats._times.items()}


def get_batchsize_forward_time_summary() -> dict[int, tuple[int, float]]:
    """batch size -> (forward passes, median ms), every size seen at least once (`/metrics`)."""
    return {
        size: (len(ms), statistics.median(ms))
        for size, ms in get_batchsize_forward_time_samples().items()
        if ms
    }


def reset_batchsize_forward_time_stats(interval_s: float | None = None) -> None:
    """Clear all samples and re-read the interval (from the argument, else the environment)."""
    batchsize_forward_stats.reset(interval_s)
