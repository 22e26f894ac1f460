"""`tokenwise serve --headless`: a host that only runs engine cores for a front end elsewhere.

Data parallelism across hosts is launched like vLLM's: the first host runs the front end (the
API server, or `LLM`) with ranks [0, L0) and `--data-parallel-size-local L0`; every other host
runs `tokenwise serve MODEL --headless` with its `--data-parallel-start-rank R` and
`--data-parallel-size-local L`, pointing at the first host (`--data-parallel-address`,
`--data-parallel-rpc-port`). No torchrun: each host starts its own core processes, which
connect to the front end (`remote_core`). This process only supervises them (or, with one
rank, is that core itself): it exits when they all have (the front end stopped them, or went
away), with status 1 if any failed.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import sys
from typing import Any

from tokenwise.config import EngineConfig, ParallelConfig
from tokenwise.engine.remote_core import run_remote_engine_core
from tokenwise.engine.remote_ranks import cluster_secret, engine_ready_timeout_s, rpc_endpoint

JOIN_POLL_S = 0.5


def check_headless(parallel: ParallelConfig, address_given: bool) -> None:
    """Refuse a headless layout that cannot work, naming the flag."""
    if not address_given:
        raise ValueError(
            "--headless needs --data-parallel-address: the address of the front end's host "
            "(the first host, where `tokenwise serve` runs without --headless)"
        )
    if parallel.data_parallel_size < 2:
        raise ValueError(
            f"--headless needs --data-parallel-size >= 2 (the global number of ranks), got "
            f"{parallel.data_parallel_size}"
        )
    if parallel.data_parallel_start_rank < 1:
        raise ValueError(
            "--headless needs --data-parallel-start-rank >= 1 (rank 0 runs on the front end's "
            f"host), got {parallel.data_parallel_start_rank}"
        )
    check_hosts_layout(parallel)
    cluster_secret(parallel.data_parallel_master_ip, "--data-parallel-address")


def check_hosts_layout(parallel: ParallelConfig) -> None:
    """What DP across hosts does not support yet, refused rather than half working."""
    if not parallel.spans_hosts:
        return
    if parallel.ray_data_parallel:
        why = "with data_parallel_backend='ray'"
    else:
        why = (
            f"when data-parallel ranks span hosts (data_parallel_size_local="
            f"{parallel.local_dp_size} < data_parallel_size={parallel.data_parallel_size})"
        )
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        if getattr(parallel, name) != 1:
            raise ValueError(f"{name} must be 1 {why}; not built yet")


def run_headless(config: EngineConfig) -> int:
    """Start this host's ranks, wait for them; the exit status (0 when all stopped cleanly)."""
    parallel = config.parallel
    first = parallel.data_parallel_start_rank
    ranks = list(range(first, first + parallel.local_dp_size))
    timeout = engine_ready_timeout_s()
    ctx = mp.get_context("spawn")
    procs: list[Any] = [
        ctx.Process(
            target=run_remote_engine_core,
            args=(config, rank, timeout),
            name=f"tokenwise-dp-{rank}",
            daemon=True,
        )
        for rank in ranks
    ]
    print(
        f"tokenwise: headless: data-parallel ranks {ranks} of {parallel.data_parallel_size}, "
        f"front end at {rpc_endpoint(parallel)}",
        file=sys.stderr,
        flush=True,
    )
    if len(ranks) == 1:
        # One rank: this process is the core (no second interpreter to start, nothing to
        # supervise); it returns when the front end stops it and raises SystemExit on failure.
        run_remote_engine_core(config, ranks[0], timeout)
        return 0
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        for proc in procs:
            proc.start()
        while any(proc.is_alive() for proc in procs):
            for proc in procs:
                proc.join(JOIN_POLL_S)
    finally:
        signal.signal(signal.SIGTERM, previous)
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(5.0)
    failed = [r for r, proc in zip(ranks, procs, strict=True) if proc.exitcode != 0]
    if failed:
        print(
            f"tokenwise: headless: ranks {failed} stopped with an error",
            file=sys.stderr,
            flush=True,
        )
        return 1
    return 0


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt
