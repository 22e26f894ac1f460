"""A pipeline stage's process: the one entry point of every stage other than stage 0.

The engine (stage 0) spawns one process per other stage (`pp_launch.start_pipeline_parallel`);
each runs `run_pp_worker`: join the group, build its layers and their KV cache slices (one per
virtual engine), then run the micro-batches the previous stage sends until told to stop. A stage
has no scheduler and no requests. It sits above the runner (it builds one).
"""

from __future__ import annotations

import logging
import traceback

from tokenwise.config import EngineConfig
from tokenwise.distributed.lifecycle import watch_parent
from tokenwise.distributed.pp_launch import limit_cpu_threads
from tokenwise.distributed.pp_state import destroy_pp_group, init_pp_group
from tokenwise.distributed.startup import start_runner
from tokenwise.platform import configure_cpu_allocator
from tokenwise.runner.pipeline_runner import PipelineModelRunner

logger = logging.getLogger("tokenwise.engine")


def run_pp_worker(config: EngineConfig, rank: int, init_method: str | None) -> None:
    """Join, build this stage and its caches, serve micro-batches until the driver stops.

    The same collectives in the same order as the driver's `LLMEngine.__init__`: the group,
    then the agreed block count (`PipelineModelRunner.determine_num_blocks`). Returns when told
    to stop; a failure is logged and ends the process with exit status 1 (the driver names the
    dead stage in its next transfer's error).
    """
    parallel = config.parallel
    tp = parallel.tensor_parallel_size
    stage = rank // tp
    logging.basicConfig(level=logging.INFO, format=f"[PP stage {stage}] %(levelname)s %(message)s")
    if not str(config.device).startswith("cuda"):
        configure_cpu_allocator()
    limit_cpu_threads(config)
    if init_method is not None:  # spawned: leave with the driver, however it ends
        watch_parent()
    try:
        init_pp_group(
            parallel.pipeline_parallel_size, tp, stage, rank % tp, init_method, config.device
        )
        runner, _ = start_runner(lambda: PipelineModelRunner(config, config.device))
        runner.serve_pipeline_steps()
    except BaseException:
        logger.error("pipeline stage %d failed:\n%s", stage, traceback.format_exc())
        raise SystemExit(1) from None
    finally:
        destroy_pp_group()
