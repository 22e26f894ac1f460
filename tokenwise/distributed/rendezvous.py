"""Bounded waits on other processes: the rendezvous, and the driver's collectives.

A spawned world used to meet inside `torch.distributed.init_process_group`, which waits up to
its whole timeout (minutes) for a rank that will never come: a worker whose spawn failed (a
script without an `if __name__ == "__main__":` guard), one killed while importing, one out of
memory. Here every process first connects to a plain `TCPStore` (global rank 0 hosts it) and
writes an arrival key; a process that spawned workers polls those keys while checking its own
workers' liveness, so a dead worker ends start-up at once, with its rank, pid and exit code,
and a worker that never arrives ends it after `worker_start_timeout_s()` (60 s unless
`TOKENWISE_WORKER_START_TIMEOUT_S` says otherwise). Only once every rank has arrived does the
process group form over the same store, which then takes milliseconds.

`wait_polled` does the same for a collective the driver started with `async_op=True`: the KV
cache sizing all-reduce (after every rank built its model, which may legitimately take long:
no deadline while every worker lives) and each step's message to the workers
(`tp_broadcast`, bounded by the activation timeout). A dead worker ends either at once.

The store's host binds its listening socket itself (`open_store`): torch's `TCPStore` listens
on every interface whatever host it is given, and its protocol has no authentication, so a
world meeting on 127.0.0.1 would otherwise be open to the network. Bound to the address the
world meets at, a loopback world stays on loopback. A world that meets beyond loopback (ranks
on several hosts: the Ray executor's) needs `TOKENWISE_CLUSTER_SECRET`: each rank's arrival
key carries an HMAC of the secret over the rendezvous address and its rank
(`arrival_proof`), and the driver refuses a world in which a rank arrived without it, so a
stranger who reaches the port cannot take a rank's place (the store and gloo still carry
plain TCP: the network between the hosts must be trusted not to read or forge traffic).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import time
from datetime import timedelta
from typing import Any, Protocol
from urllib.parse import urlparse

import torch.distributed as dist

from tokenwise import envs
from tokenwise.kv_cache.events_config import is_loopback

ENV_WORKER_START_TIMEOUT = "TOKENWISE_WORKER_START_TIMEOUT_S"
# The shared secret of the engine's sockets between hosts (`engine.remote_ranks` uses it too).
SECRET_ENV = "TOKENWISE_CLUSTER_SECRET"
DEFAULT_WORKER_START_TIMEOUT_S = 60.0
POLL_INTERVAL_S = 0.05
LIVENESS_CHECK_S = 0.2  # how often a collective's wait looks at the workers
# The hint for the commonest cause of a worker dying before it arrives.
MAIN_GUARD_HINT = (
    "workers are started with multiprocessing's spawn, which re-imports the main module: a "
    "script that builds the engine must do so under `if __name__ == '__main__':`"
)


class WorkerLostError(RuntimeError):
    """A worker the driver waited on died, never arrived, or stopped answering."""


class Liveness(Protocol):
    """What a process that spawned workers knows of them (`tp_launch.TPWorkers`)."""

    def dead_worker(self) -> str | None: ...

    def missing(self, ranks: list[int]) -> str: ...

    def everyone(self) -> str: ...


def worker_start_timeout_s() -> float:
    """How long a spawned process may take to reach the rendezvous (import, connect)."""
    text = envs.get(ENV_WORKER_START_TIMEOUT).strip()
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


def arrival_proof(init_method: str, rank: int) -> str:
    """What `rank` writes beside its pid on arrival: "" at a loopback rendezvous, else an
    HMAC of `TOKENWISE_CLUSTER_SECRET` over the address and the rank (refused without it)."""
    host = urlparse(init_method).hostname or ""
    if is_loopback(host):
        return ""
    secret = envs.get(SECRET_ENV)
    if not secret:
        raise ValueError(
            f"the ranks' rendezvous {init_method} is beyond loopback, which needs {SECRET_ENV} "
            "set to the same value for every rank (see docs/cluster.md)"
        )
    message = f"tokenwise-rendezvous/{init_method}/{rank}".encode()
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def open_store(
    host: str, port: int, world: int, is_master: bool, timeout: timedelta
) -> dist.TCPStore:
    """A `TCPStore` at host:port; the master listens on that address only (see above)."""
    listen_fd = None
    if is_master:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        listener = socket.socket(family, kind, proto)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(address)
            listener.listen(128)
        except OSError as exc:
            listener.close()
            raise ValueError(f"the rendezvous cannot listen on {host}:{port}: {exc}") from None
        listen_fd = listener.detach()  # the store owns the socket from here on
    return dist.TCPStore(
        host,
        port,
        world,
        is_master=is_master,
        timeout=timeout,
        wait_for_workers=False,
        master_listen_fd=listen_fd,
    )


def open_rendezvous(init_method: str, world: int, rank: int) -> dist.TCPStore:
    """Connect to (global rank 0: host) the world's store at `tcp://host:port` and say that
    this rank has arrived. A client retries its connection until the start-up timeout."""
    url = urlparse(init_method)
    if url.scheme != "tcp" or url.hostname is None or url.port is None:
        raise ValueError(f"init_method must be tcp://host:port, got {init_method!r}")
    proof = arrival_proof(init_method, rank)
    timeout = timedelta(seconds=worker_start_timeout_s())
    store = open_store(url.hostname, url.port, world, rank == 0, timeout)
    store.set(arrival_key(rank), f"{os.getpid()} {proof}".rstrip())
    return store


def wait_for_arrivals(
    store: dist.Store, world: int, rank: int, workers: Liveness, init_method: str = ""
) -> None:
    """Return once every rank of the world has arrived; raise `WorkerLostError` naming the
    worker as soon as one of `workers` is dead, or the ranks still missing at the deadline.
    Beyond loopback every arrival must carry its `arrival_proof` for `init_method`."""
    timeout = worker_start_timeout_s()
    deadline = time.monotonic() + timeout
    missing = [r for r in range(world) if r != rank]
    checked = bool(init_method) and not is_loopback(urlparse(init_method).hostname or "")
    while True:
        arrived = [r for r in missing if store.check([arrival_key(r)])]
        if checked:
            for r in arrived:
                _check_proof(store, init_method, r)
        missing = [r for r in missing if r not in arrived]
        if not missing:
            return
        dead = workers.dead_worker()
        if dead is not None:
            raise WorkerLostError(
                f"{dead} before joining the engine's process group ({MAIN_GUARD_HINT})"
            )
        if time.monotonic() > deadline:
            raise WorkerLostError(
                f"{workers.missing(missing)} did not reach the rendezvous within {timeout:g} s "
                f"(raise {ENV_WORKER_START_TIMEOUT} for a slow start)"
            )
        time.sleep(POLL_INTERVAL_S)


def _check_proof(store: dist.Store, init_method: str, rank: int) -> None:
    """Refuse a world in which `rank` arrived without proving it holds the secret."""
    _, _, proof = store.get(arrival_key(rank)).decode(errors="replace").partition(" ")
    if not hmac.compare_digest(proof, arrival_proof(init_method, rank)):
        raise WorkerLostError(
            f"a process arrived at the rendezvous {init_method} as rank {rank} without "
            f"{SECRET_ENV}'s proof (a rank with another secret, or a stranger): refused"
        )


def wait_polled(
    work: Any, workers: Liveness | None, what: str, timeout_s: float | None = None
) -> None:
    """Wait for an `async_op=True` collective, checking `workers` while it runs: a dead one
    ends the wait with an error naming it (the collective itself would wait out its timeout
    for a peer that stopped before joining it), and so does `timeout_s` (None: as long as the
    workers live, e.g. while they build their shards). Without workers (a worker itself):
    plain wait; its driver bounds it, and kills it on failure. The wait itself is gloo's
    (`work.wait(timeout)` returns the moment the collective completes and leaves it running
    when it times out), so checking costs a step nothing."""
    if workers is not None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        slice_ = timedelta(seconds=LIVENESS_CHECK_S)
        while True:
            try:
                work.wait(timeout=slice_)
                return
            except Exception as exc:
                if work.is_completed():  # it failed (a peer's socket closed), not timed out
                    dead = dead_within(workers, 1.0)
                    if dead is not None:
                        raise WorkerLostError(f"{dead} while {what}") from exc
                    raise
            dead = workers.dead_worker()
            if dead is not None:
                raise WorkerLostError(f"{dead} while {what}")
            if deadline is not None and time.monotonic() > deadline:
                raise WorkerLostError(
                    f"{what} did not finish within {timeout_s:g} s: {workers.everyone()} "
                    "alive but not answering"
                )
    work.wait()


def dead_within(workers: Liveness, seconds: float) -> str | None:
    """A dead worker, giving one that is dying (its socket already closed) `seconds` to go."""
    deadline = time.monotonic() + seconds
    while True:
        dead = workers.dead_worker()
        if dead is not None or time.monotonic() > deadline:
            return dead
        time.sleep(POLL_INTERVAL_S)
