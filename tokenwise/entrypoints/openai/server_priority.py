"""The API server process yields the CPU to its engine-core processes.

With the engine in core processes (`tokenwise serve`'s default), the server process does each
token's HTTP work (reading the core's output, building and writing the SSE chunk) while the
core runs the next forward pass. On a CPU the core's forward uses one OpenMP thread per core;
every thread must reach each operator's barrier before any goes on, so when the server wakes
and the kernel gives it one of those cores, the other thread waits at the barrier for as long
as the server runs. One stream through `tokenwise serve` lost most of its distance to the
offline engine that way (benchmarks/serve_vs_offline.py).

So once its cores are started (they keep the priority the server was started with), the
server lowers its own scheduling priority (a higher `nice` value, `TOKENWISE_SERVER_NICE`):
the kernel then runs it on a core the forward leaves idle (a barrier wait, the core's
scheduling between steps) instead of preempting an OpenMP thread. It still gets CPU while the
cores work: the kernel's fair share at that weight, so nothing starves. Linux keeps a
priority per thread, so every thread the process has is lowered (threads started later
inherit it). An in-process engine (`TOKENWISE_ENABLE_MULTIPROCESSING=0`) is left alone: its
forward runs in this very process.
"""

from __future__ import annotations

import logging
import os

from tokenwise import envs

logger = logging.getLogger("tokenwise.server")

NICE_ENV = "TOKENWISE_SERVER_NICE"
MAX_NICE = 19  # Linux's lowest priority


def server_nice() -> int:
    """`TOKENWISE_SERVER_NICE` as an int in [0, 19] (0: leave the priority as it is)."""
    raw = envs.get(NICE_ENV).strip()
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{NICE_ENV} must be an integer in [0, {MAX_NICE}], got {raw!r}") from None
    if not 0 <= value <= MAX_NICE:
        raise ValueError(f"{NICE_ENV} must be in [0, {MAX_NICE}], got {value}")
    return value


def _thread_ids() -> list[int]:
    try:
        return [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:  # no /proc (not Linux): the process-wide call is all there is
        return [0]


def yield_to_engine_cores(increment: int | None = None) -> int:
    """Lower this process's priority by `increment` (default `server_nice()`) nice levels,
    every thread of it; the nice value it has afterwards. Where the platform refuses, it logs
    why and serves on at the priority it has."""
    increment = server_nice() if increment is None else increment
    if increment == 0 or not hasattr(os, "setpriority"):
        return os.getpriority(os.PRIO_PROCESS, 0) if hasattr(os, "getpriority") else 0
    for tid in _thread_ids():
        try:
            current = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, min(MAX_NICE, current + increment))
        except OSError as exc:  # a thread that just ended, or a sandbox without the call
            logger.debug("could not lower the priority of thread %d: %s", tid, exc)
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    logger.info("API server process at nice %d: the engine cores' forward passes come first", nice)
    return nice
