"""Tensor parallelism: the worker processes beside the driver, and how a run joins its group.

With `tensor_parallel_size=N` one engine's model is split over N processes. The driver (TP rank
0) is the ordinary engine: it schedules, prepares each step's inputs and samples. Workers hold
only their shards and a KV cache for their heads; every step the driver broadcasts the step's
flat inputs (`ModelRunner._broadcast`), each worker builds the same attention metadata from
them and runs the same forward pass, and the layers' all-reduces / all-gathers combine the
shards. Two ways to start:

- spawned (default): the driver starts N-1 worker processes itself and rendezvouses with them
  over TCP on 127.0.0.1;
- `torchrun --nproc-per-node N [--nnodes M ...]`: every process runs the same command, the
  group comes from torchrun's environment, rank 0 becomes the driver and the other ranks hand
  over to the worker entry point before any engine is built (`tokenwise.executor.worker_main`)
  and exit when the driver shuts down.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from tokenwise import envs
from tokenwise.config import EngineConfig
from tokenwise.distributed.parallel_state import destroy_dp_group, init_dp_group
from tokenwise.distributed.rendezvous import WorkerLostError, dead_within
from tokenwise.distributed.tp_state import (
    abort_join,
    destroy_tp_group,
    free_port,
    init_tp_group,
    is_tp_initialized,
)

logger = logging.getLogger("tokenwise.engine")

WorkerMain = Callable[[EngineConfig, int, "str | None"], None]

STOP_TIMEOUT_S = 10.0
# As the DP ranks' own collectives (`dp_rank.COLLECTIVE_TIMEOUT_S`): a long prefill on one rank
# keeps the others waiting in the next exchange.
DP_COLLECTIVE_TIMEOUT_S = 300.0


def launched_by_torchrun() -> bool:
    """torchrun (and other launchers using its environment) set these for every process."""
    return envs.external("TORCHELASTIC_RUN_ID") is not None or (
        all(envs.external(n) is not None for n in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))
    )


def torchrun_tp_rank(config: EngineConfig) -> int | None:
    """This process's TP rank when torchrun launched a tensor-parallel run, else None."""
    parallel = config.parallel
    if parallel.tensor_parallel_size == 1 or not launched_by_torchrun():
        return None
    if parallel.data_parallel_size > 1:
        raise ValueError(
            "data_parallel_size > 1 under torchrun is not supported: the engine starts its "
            "DP ranks itself; launch with tensor parallelism only"
        )
    return int(envs.external("RANK") or 0)


def _tp_worker_name(rank: int) -> str:
    return f"tensor-parallel worker {rank}"


class TPWorkers:
    """The N-1 spawned worker processes of one engine; the driver checks on them every step.

    `world_size` (default: the TP size) processes in all, this one being rank 0;
    `describe(rank)` names a worker in errors (the pipeline's workers are stages, not TP ranks).
    """

    def __init__(
        self,
        config: EngineConfig,
        init_method: str,
        worker_main: WorkerMain,
        world_size: int | None = None,
        describe: Callable[[int], str] = _tp_worker_name,
        first_rank: int = 0,
    ) -> None:
        size = world_size or config.parallel.tensor_parallel_size
        self.describe = describe
        self.first_rank = first_rank  # this driver's global rank (DP rank * TP size under DP)
        # Where the world meets; a launcher whose ranks run on other hosts moves it off
        # loopback in `_start` (the Ray executor's), and the driver joins where it says.
        self.init_method = init_method
        # Handles with `multiprocessing.Process`'s face (pid, exitcode, is_alive, join, kill):
        # processes here, Ray actors for the Ray executor (`executor/ray_workers.py`).
        self.procs: list[Any] = self._start(config, init_method, worker_main, size)
        self._finalizer = weakref.finalize(self, _reap, self.procs)

    def _start(
        self, config: EngineConfig, init_method: str, worker_main: WorkerMain, size: int
    ) -> list[Any]:
        """Start ranks 1..size-1, each running `worker_main(config, rank, init_method)`."""
        ctx = mp.get_context("spawn")  # fork would copy torch's threads and locks
        procs = [
            ctx.Process(
                target=worker_main,
                args=(config, rank, init_method),
                name=f"tokenwise-rank-{rank}",
                daemon=True,
            )
            for rank in range(1, size)
        ]
        for proc in procs:
            proc.start()
        return procs

    def dead_worker(self) -> str | None:
        """A sentence naming the first worker that has exited, if any has."""
        for rank, proc in enumerate(self.procs, start=1):
            if proc.exitcode is not None:
                return f"{self.describe(rank)} (pid {proc.pid}) exited with code {proc.exitcode}"
        return None

    def missing(self, ranks: list[int]) -> str:
        """Name the processes of global `ranks` (still missing at the rendezvous): this
        driver's own workers with their pids, other drivers' processes by global rank."""
        names = []
        for rank in ranks:
            local = rank - self.first_rank
            if 1 <= local <= len(self.procs):
                names.append(f"{self.describe(local)} (pid {self.procs[local - 1].pid})")
            else:
                names.append(f"global rank {rank} (another data-parallel rank's process)")
        return ", ".join(names)

    def everyone(self) -> str:
        """Every spawned worker, named with its pid."""
        return ", ".join(
            f"{self.describe(rank)} (pid {proc.pid})" for rank, proc in enumerate(self.procs, 1)
        )

    def kill(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()

    def join(self) -> None:
        self._finalizer()


def _reap(procs: list[Any]) -> None:
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=STOP_TIMEOUT_S)


def join_parallel_groups(
    config: EngineConfig,
    tp_rank: int,
    init_method: str | None,
    workers: TPWorkers | None = None,
) -> None:
    """Join this engine's TP group and, under DP x TP, the DP group of the ranks sharing this
    TP rank (the one MoE layers exchange tokens over). Both are collective: the driver and
    every worker of every DP rank make the same calls in the same order. `workers`: those
    the driver spawned, checked while it waits for them at the rendezvous."""
    parallel = config.parallel
    dp_size, dp_rank = parallel.data_parallel_size, parallel.data_parallel_rank
    init_tp_group(
        parallel.tensor_parallel_size,
        tp_rank,
        init_method,
        config.device,
        dp_size,
        dp_rank,
        workers,
    )
    if dp_size > 1:
        init_dp_group(parallel, timeout_s=DP_COLLECTIVE_TIMEOUT_S, device=config.device)


def start_tensor_parallel(
    config: EngineConfig,
    worker_main: WorkerMain | None,
    launcher: type[TPWorkers] | None = None,
) -> TPWorkers | None:
    """Join (and, unless torchrun did, start) this engine's TP group; None with TP size 1.

    Called before the model is built, since the layers read their TP rank at construction.
    `worker_main(config, rank, init_method)` is what each spawned worker runs
    (`tokenwise.executor.worker_main.run_tp_worker`, passed in because it sits above this
    module); None where no worker can be spawned (a worker's own runner). `launcher` starts
    them (default `TPWorkers`: spawned processes; the Ray executor's starts Ray actors).
    Returns the started workers on the driver of a started group, None otherwise.
    Under DP x TP every DP rank is the driver of its own TP group, and all `dp * tp` processes
    rendezvous at the DP address and port.
    """
    parallel = config.parallel
    size = parallel.tensor_parallel_size
    if size == 1:
        return None
    processes = size * parallel.data_parallel_size
    if not str(config.device).startswith("cuda") and envs.external("OMP_NUM_THREADS") is None:
        # N ranks on one CPU: share its cores instead of each claiming all of them.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // processes))
    if is_tp_initialized():  # a spawned worker joined before building its runner
        return None
    rank = torchrun_tp_rank(config)
    if rank is not None:
        init_tp_group(size, rank, None, config.device)
        logger.info("tensor-parallel rank %d of %d (torchrun)", rank, size)
        return None
    if parallel.data_parallel_size > 1:
        if parallel.data_parallel_master_port is None:
            raise ValueError("DP x TP needs the DP rendezvous port (data_parallel_master_port)")
        init_method = (
            f"tcp://{parallel.data_parallel_master_ip}:{parallel.data_parallel_master_port}"
        )
    else:
        init_method = f"tcp://127.0.0.1:{free_port()}"
    if worker_main is None:
        raise ValueError(
            f"tensor_parallel_size={size} needs the TP worker entry point to spawn workers: "
            "start the engine through LLMEngine (its executor spawns them)"
        )
    workers = (launcher or TPWorkers)(
        config, init_method, worker_main, first_rank=size * parallel.data_parallel_rank
    )
    with startup_failures_named(workers):
        join_parallel_groups(config, 0, workers.init_method, workers)
    return workers


@contextmanager
def startup_failures_named(workers: TPWorkers) -> Iterator[None]:
    """On a failed start-up: stop the workers, leave no group behind, and name a dead worker
    (a collective that failed because a peer died says only that a socket closed)."""
    try:
        yield
    except BaseException as exc:
        dead = dead_within(workers, 1.0)
        workers.kill()
        workers.join()
        destroy_dp_group()
        destroy_tp_group()
        abort_join()
        if dead is not None and not isinstance(exc, WorkerLostError):
            raise WorkerLostError(
                f"{dead} while the engine was starting ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''})"
            ) from exc
        raise
