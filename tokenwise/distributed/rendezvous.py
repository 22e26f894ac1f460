"""Bounded waits on other processes at start-up: the rendezvous and the first collectives.

A spawned world used to meet inside `torch.distributed.init_process_group`, which waits up to
its whole timeout (minutes) for a rank that will never come: a worker whose spawn failed (a
script without an `if __name__ == "__main__":` guard), one killed while importing, one out of
memory. Here every process first connects to a plain `TCPStore` (global rank 0 hosts it) and
writes an arrival key; a process that spawned workers polls those keys while checking its own
workers' liveness, so a dead worker ends start-up at once, with its rank, pid and exit code,
and a worker that never arrives ends it after `worker_start_timeout_s()` (60 s unless
`TOKENWISE_WORKER_START_TIMEOUT_S` says otherwise). Only once every rank has arrived does the
process group form over the same store, which then takes milliseconds.

`wait_polled` does the same for a collective started with `async_op=True` (the KV cache
sizing all-reduce runs after every rank built its model, which may legitimately take long): it
waits without a deadline as long as every worker lives, and fails as soon as one is gone.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any, Protocol
from urllib.parse import urlparse

import torch.distributed as dist

ENV_WORKER_START_TIMEOUT = "TOKENWISE_WORKER_START_TIMEOUT_S"
DEFAULT_WORKER_START_TIMEOUT_S = 60.0
POLL_INTERVAL_S = 0.05
# The hint for the commonest cause of a worker dying before it arrives.
MAIN_GUARD_HINT = (
    "workers are started with multiprocessing's spawn, which re-imports the main module: a "
    "script that builds the engine must do so under `if __name__ == '__main__':`"
)


class WorkerStartupError(RuntimeError):
    """A worker died or never arrived while the engine was starting."""


class Liveness(Protocol):
    """What a process that spawned workers knows of them (`tp_launch.TPWorkers`)."""

    def dead_worker(self) -> str | None: ...

    def missing(self, ranks: list[int]) -> str: ...


def worker_start_timeout_s() -> float:
    """How long a spawned process may take to reach the rendezvous (import, connect)."""
    text = os.environ.get(ENV_WORKER_START_TIMEOUT, "").strip()
    if not text:
        return DEFAULT_WORKER_START_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(
            f"{ENV_WORKER_START_TIMEOUT} must be a number of seconds > 0, got {text!r}"
        )
    return value


def arrival_key(rank: int) -> str:
    return f"tokenwise/arrived/{rank}"


def open_rendezvous(init_method: str, world: int, rank: int) -> dist.TCPStore:
    """Connect to (global rank 0: host) the world's store at `tcp://host:port` and say that
    this rank has arrived. A client retries its connection until the start-up timeout."""
    url = urlparse(init_method)
    if url.scheme != "tcp" or url.hostname is None or url.port is None:
        raise ValueError(f"init_method must be tcp://host:port, got {init_method!r}")
    store = dist.TCPStore(
        url.hostname,
        url.port,
        world,
        is_master=rank == 0,
        timeout=timedelta(seconds=worker_start_timeout_s()),
        wait_for_workers=False,
    )
    store.set(arrival_key(rank), str(os.getpid()))
    return store


def wait_for_arrivals(store: dist.Store, world: int, rank: int, workers: Liveness) -> None:
    """Return once every rank of the world has arrived; raise `WorkerStartupError` naming the
    worker as soon as one of `workers` is dead, or the ranks still missing at the deadline."""
    timeout = worker_start_timeout_s()
    deadline = time.monotonic() + timeout
    missing = [r for r in range(world) if r != rank]
    while True:
        missing = [r for r in missing if not store.check([arrival_key(r)])]
        if not missing:
            return
        dead = workers.dead_worker()
        if dead is not None:
            raise WorkerStartupError(
                f"{dead} before joining the engine's process group ({MAIN_GUARD_HINT})"
            )
        if time.monotonic() > deadline:
            raise WorkerStartupError(
                f"{workers.missing(missing)} did not reach the rendezvous within {timeout:g} s "
                f"(raise {ENV_WORKER_START_TIMEOUT} for a slow start)"
            )
        time.sleep(POLL_INTERVAL_S)


def wait_polled(work: Any, workers: Liveness | None, what: str) -> None:
    """Wait for an `async_op=True` collective, checking `workers` while it runs: a dead one
    ends the wait with an error naming it (the collective itself would wait out its timeout
    for a peer that stopped before joining it). Without workers (a worker itself): plain
    wait; its driver bounds it, and kills it on failure."""
    if workers is not None:
        while not work.is_completed():
            dead = workers.dead_worker()
            if dead is not None:
                raise WorkerStartupError(f"{dead} while {what}")
            time.sleep(POLL_INTERVAL_S)
    try:
        work.wait()
    except Exception as exc:  # a peer's socket closed: name it if it is one of ours
        dead = dead_within(workers, 1.0) if workers is not None else None
        if dead is not None:
            raise WorkerStartupError(f"{dead} while {what}") from exc
        raise


def dead_within(workers: Liveness, seconds: float) -> str | None:
    """A dead worker, giving one that is dying (its socket already closed) `seconds` to go."""
    deadline = time.monotonic() + seconds
    while True:
        dead = workers.dead_worker()
        if dead is not None or time.monotonic() > deadline:
            return dead
        time.sleep(POLL_INTERVAL_S)
