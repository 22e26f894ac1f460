"""Run a function on N spawned ranks and collect what each reports, within a deadline.

Each rank's target is called as `target(rank, port, *args, results)` and must put
`(rank, report)` on `results` (a report with an "error" key fails the test with its text).
A rank that dies or a run past the deadline fails the test instead of hanging it.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
from collections.abc import Callable
from typing import Any

import pytest

from tokenwise.distributed.tp_state import free_port


def run_ranks(
    target: Callable[..., None], num_ranks: int, *args: Any, deadline_s: float = 60.0
) -> dict[int, Any]:
    ctx = mp.get_context("spawn")
    results: Any = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=target, args=(r, port, *args, results), daemon=True)
        for r in range(num_ranks)
    ]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    deadline = time.monotonic() + deadline_s
    try:
        while len(got) < num_ranks:
            if time.monotonic() > deadline:
                pytest.fail(f"ranks timed out after {deadline_s}s; reported: {sorted(got)}")
            try:
                rank, report = results.get(timeout=1.0)
                got[rank] = report
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    pytest.fail(f"rank(s) {dead} died; reported: {sorted(got)}")
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    for rank, report in got.items():
        assert "error" not in report, f"rank {rank}:\n{report['error']}"
    return got
