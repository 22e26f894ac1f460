"""The entry point of every rank other than the driver: join, build a worker, serve, exit.

A rank holds its shard of the model (its TP heads, or its pipeline stage's layers) and a KV
cache for it, and runs what the driver sends; it has no scheduler and no requests. It starts
in one of two ways:

- spawned by the driver's executor (`MultiprocExecutor`): `run_tp_worker` / `run_pp_worker` is
  the spawned process's target, given the rendezvous address;
- launched by `torchrun`: every process runs the caller's command, so the engine constructors
  (`create_engine`, and `LLMEngine` itself) first call `maybe_serve_torchrun_worker`. On rank 0
  and outside torchrun it returns at once and the engine is built; on any other rank no engine
  is built: the rank serves the driver and then the process ends, with exit status 0 once the
  driver has shut down (1 if the rank failed), so the caller's code after the constructor runs
  on rank 0 only.

Either way the rank runs the same start-up sequence as the driver (`Worker.start`): group,
model, agreed block count, cache; then its loop. A failure is logged and ends the process
with exit status 1 (the driver names the dead rank in its next wait's error); a spawned rank
also exits when its driver dies.
"""

from __future__ import annotations

import logging
import sys
import traceback

from tokenwise import envs
from tokenwise.config import EngineConfig
from tokenwise.distributed.lifecycle import watch_parent
from tokenwise.distributed.parallel_state import destroy_dp_group
from tokenwise.distributed.pp_channel import PipelineChannel
from tokenwise.distributed.pp_launch import limit_cpu_threads, torchrun_pp_rank
from tokenwise.distributed.pp_state import destroy_pp_group, init_pp_group
from tokenwise.distributed.tp_channel import TPDriver
from tokenwise.distributed.tp_launch import join_parallel_groups, torchrun_tp_rank
from tokenwise.distributed.tp_state import destroy_tp_group
from tokenwise.executor.worker import Worker

logger = logging.getLogger("tokenwise.engine")


def _prepare(config: EngineConfig, name: str, init_method: str | None) -> None:
    logging.basicConfig(level=logging.INFO, format=f"[{name}] %(levelname)s %(message)s")
    if init_method is not None:  # spawned: leave with the driver, however it ends
        watch_parent()


def run_tp_worker(config: EngineConfig, rank: int, init_method: str | None) -> None:
    """A tensor-parallel rank: join the group, start its worker, serve until told to stop.
    `init_method` is the spawned group's `tcp://` rendezvous, or None under torchrun."""
    name = f"TP rank {rank}"
    if config.parallel.data_parallel_size > 1:
        name = f"DP rank {config.parallel.data_parallel_rank} {name}"
    _prepare(config, name, init_method)
    try:
        join_parallel_groups(config, rank, init_method)
        worker = Worker(config, config.device, TPDriver(None))
        worker.start()
        worker.serve()
    except BaseException:
        logger.error("tensor-parallel worker %d failed:\n%s", rank, traceback.format_exc())
        raise SystemExit(1) from None
    finally:
        destroy_dp_group()
        destroy_tp_group()


def run_pp_worker(config: EngineConfig, rank: int, init_method: str | None) -> None:
    """A pipeline rank (stage `rank // tp`, TP rank `rank % tp` within it): join, start its
    worker (its layers and one KV-cache slice per virtual engine), serve micro-batches."""
    parallel = config.parallel
    tp = parallel.tensor_parallel_size
    stage = rank // tp
    _prepare(config, f"PP stage {stage}", init_method)
    limit_cpu_threads(config)
    try:
        init_pp_group(
            parallel.pipeline_parallel_size, tp, stage, rank % tp, init_method, config.device
        )
        assert config.model is not None
        hidden_size = int(config.model.hf_config.hidden_size)
        channel = PipelineChannel(None, config.model.dtype, hidden_size)
        worker = Worker(config, config.device, TPDriver(None), pipeline=channel)
        worker.start()
        worker.serve()
    except BaseException:
        logger.error("pipeline stage %d failed:\n%s", stage, traceback.format_exc())
        raise SystemExit(1) from None
    finally:
        destroy_pp_group()


def maybe_serve_torchrun_worker(config: EngineConfig) -> None:
    """On a torchrun rank other than 0: serve the driver, then end the process (status 0).

    Returns at once (nothing done) outside torchrun, with no parallelism, and on rank 0,
    which goes on to build the engine. The engine constructors call this before building
    anything, so a worker rank never holds an engine.
    """
    if config.parallel.pipeline_parallel_size > 1:
        rank = torchrun_pp_rank(config)
        if rank is None or rank == 0:
            return
        logger.info("pipeline rank %d (torchrun): serving rank 0's micro-batches", rank)
        run_pp_worker(config, rank, None)
        logger.info("pipeline rank %d: the driver shut down; exiting", rank)
        sys.exit(0)
    rank = torchrun_tp_rank(config)
    if rank is None or rank == 0:
        return
    logger.info(
        "tensor-parallel rank %d of %d (torchrun): serving rank 0's steps",
        rank,
        envs.external("WORLD_SIZE"),
    )
    run_tp_worker(config, rank, None)
    logger.info("tensor-parallel rank %d: the driver shut down; exiting", rank)
    sys.exit(0)
