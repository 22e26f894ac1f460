"""A tensor-parallel worker's start-up: the one entry point of every TP rank other than 0.

A worker holds its shards of the model and a KV cache for its heads, and runs each step the
driver (TP rank 0, the engine) broadcasts; it has no scheduler and no requests. It starts in one
of two ways, both ending in `run_tp_worker`:

- spawned by the driver's runner (`tensor_parallel_size=N` in one process): `run_tp_worker` is
  the spawned process's target, given the rendezvous address;
- launched by `torchrun`: every process runs the caller's command, so the engine constructors
  (`create_engine`, and `LLMEngine` itself) first call `maybe_serve_torchrun_worker`. On rank 0
  and outside torchrun it returns at once and the engine is built; on any other rank no engine
  is built: the rank serves the driver's steps and then the process ends, with exit status 0
  once the driver has shut down (1 if the worker failed), so the caller's code after the
  constructor runs on rank 0 only.

It sits above the runner (it builds one) and below the engine loop (which calls it).
"""

from __future__ import annotations

import logging
import sys
import traceback

from tokenwise import envs
from tokenwise.config import EngineConfig
from tokenwise.distributed.lifecycle import watch_parent
from tokenwise.distributed.parallel_state import destroy_dp_group
from tokenwise.distributed.pp_launch import torchrun_pp_rank
from tokenwise.distributed.pp_worker import run_pp_worker
from tokenwise.distributed.startup import start_runner
from tokenwise.distributed.tp_launch import join_parallel_groups, torchrun_tp_rank
from tokenwise.distributed.tp_state import destroy_tp_group
from tokenwise.platform import configure_cpu_allocator
from tokenwise.runner.model_runner import ModelRunner

logger = logging.getLogger("tokenwise.engine")


def run_tp_worker(config: EngineConfig, rank: int, init_method: str | None) -> None:
    """Join the group, build the shard and its cache, run the driver's steps until told to stop.

    `init_method` is the spawned group's `tcp://` rendezvous, or None under torchrun (the
    environment's). The same order of collectives as the driver's `LLMEngine.__init__`: group,
    model, agreed block count, cache; then the step loop. Returns when the driver stops the
    workers; a failure is logged and ends the process with exit status 1 (the driver names the
    dead worker in its next step's error). A spawned worker also exits when its driver dies.
    """
    name = f"TP rank {rank}"
    if config.parallel.data_parallel_size > 1:
        name = f"DP rank {config.parallel.data_parallel_rank} {name}"
    logging.basicConfig(level=logging.INFO, format=f"[{name}] %(levelname)s %(message)s")
    if not str(config.device).startswith("cuda"):
        configure_cpu_allocator()
    if init_method is not None:  # spawned: leave with the driver, however it ends
        watch_parent()
    try:
        join_parallel_groups(config, rank, init_method)
        runner, _ = start_runner(lambda: ModelRunner(config, config.device))
        runner.serve_tp_steps()
    except BaseException:
        logger.error("tensor-parallel worker %d failed:\n%s", rank, traceback.format_exc())
        raise SystemExit(1) from None
    finally:
        destroy_dp_group()
        destroy_tp_group()


def maybe_serve_torchrun_worker(config: EngineConfig) -> None:
    """On a torchrun TP rank other than 0: serve the driver, then end the process (status 0).

    Returns at once (nothing done) outside torchrun, with `tensor_parallel_size` 1, and on
    rank 0, which goes on to build the engine. The engine constructors call this before
    building anything, so a worker rank never holds an engine.
    """
    if config.parallel.pipeline_parallel_size > 1:
        _maybe_serve_torchrun_stage(config)
        return
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


def _maybe_serve_torchrun_stage(config: EngineConfig) -> None:
    """The same for a torchrun pipeline: every rank but 0 serves as its stage, then exits."""
    rank = torchrun_pp_rank(config)
    if rank is None or rank == 0:
        return
    logger.info("pipeline rank %d (torchrun): serving rank 0's micro-batches", rank)
    run_pp_worker(config, rank, None)
    logger.info("pipeline rank %d: the driver shut down; exiting", rank)
    sys.exit(0)
