"""The engine-core processes an `EngineCoreClient` starts, and naming the one that failed.

Apart from the client because both are about the processes, not the requests: starting one
core per local data-parallel rank (spawned, with the sockets' addresses), and, when something
died, working out which core caused it. The client keeps the decision (stop everything, fail
every later call); this module only starts processes and writes the error text.
"""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing.process import BaseProcess
from typing import Any

from tokenwise.config import EngineConfig
from tokenwise.engine import core_messages as msg
from tokenwise.engine.core_process import run_engine_core
from tokenwise.engine.core_sockets import CoreSockets


def start_cores(config: EngineConfig, io: CoreSockets, dp: bool) -> list[Any]:
    """One started engine-core process per local rank, connected to `io`'s addresses (with
    `data_parallel_backend="ray"`, one Ray actor per rank, which dial `io`'s TCP port)."""
    parallel = config.parallel
    if parallel.ray_data_parallel:
        from tokenwise.engine.ray_ranks import start_ray_cores  # imports Ray: only when asked

        return start_ray_cores(config)
    ctx = mp.get_context("spawn")  # fork would copy torch's threads and locks
    procs = [
        ctx.Process(
            target=run_engine_core,
            args=(
                config,
                rank,
                io.input_address(rank),
                io.out_address,
                io.control_address(rank),
            ),
            name=f"tokenwise-dp-{rank}" if dp else "tokenwise-engine-core",
            # A daemon may not start processes, and under TP (PP) each core starts its
            # workers (stages); cores also stop by themselves when this process is gone.
            daemon=parallel.tensor_parallel_size == 1 and parallel.pipeline_parallel_size == 1,
        )
        for rank in range(parallel.local_dp_size)
    ]
    for proc in procs:
        proc.start()
    return procs


def name_rank(rank: int, dp: bool) -> str:
    return f"data-parallel rank {rank}" if dp else "the engine core"


def name_ranks(ranks: list[int], dp: bool) -> str:
    return f"data-parallel ranks {ranks}" if dp else "the engine core"


def diagnose(procs: list[BaseProcess], io: CoreSockets, reports: dict[int, str], dp: bool) -> str:
    """Name the core that caused a failure, not the first one to notice it.

    When one DP rank dies, its peers fail in their next collective and report that; a rank
    that died without reporting (killed, out of memory) is the cause, so it is named first.
    `reports`: rank -> the error it reported (more are read from the outbox here).
    """
    while io.outbox.poll(0):
        message = msg.decode_from_core(io.outbox.recv())
        if isinstance(message, msg.CoreDead):
            reports.setdefault(message.rank, message.message)
    exited = [r for r, proc in enumerate(procs) if proc.exitcode is not None]
    if io.remote is not None:
        io.remote.poll()
        exited += io.remote.lost  # a lost host says nothing either
    silent = [r for r in exited if r not in reports]
    root = silent[0] if silent else min(reports, default=exited[0] if exited else 0)
    if root < len(procs):
        proc = procs[root]
        text = f"{name_rank(root, dp)} (pid {proc.pid}) "
        text += "failed" if proc.exitcode is None else f"exited with code {proc.exitcode}"
    else:
        assert io.remote is not None
        text = io.remote.describe(root)
        text += "" if root in io.remote.lost else " failed"
    also_lost = sorted(set(io.remote.lost) - {root}) if io.remote is not None else []
    if also_lost:
        text += f" (so did ranks {also_lost})"
    if root in reports:
        text += f": {reports[root].splitlines()[0]}"
    if not text.endswith("; the engine cannot continue"):  # the rank's report may say so
        text += "; the engine cannot continue"
    others = sorted(set(reports) - {root})
    if others:
        text += f" (rank {others[0]} then failed: {reports[others[0]].splitlines()[0][:300]})"
    return text
