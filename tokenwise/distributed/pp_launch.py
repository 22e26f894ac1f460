"""Pipeline parallelism: which settings it supports, and how a run's stages start.

With `pipeline_parallel_size=P` the engine process is stage 0 (and the driver: it schedules,
samples and owns every request); it spawns one process per other stage, as tensor parallelism
spawns its workers (`tp_launch.TPWorkers`), and all of them rendezvous over TCP on 127.0.0.1.
Under torchrun (`torchrun_pp_rank`) every process runs the same command: rank 0 becomes the
engine and the others stages (`executor.worker_main.maybe_serve_torchrun_worker`), over torchrun's
rendezvous, so stages may sit on different machines.
Each stage builds only its layers (`pp_state.pp_layer_range`) and a KV cache for them.

Under PP x TP the world has P * T processes (global rank `stage * T + tp_rank`); the engine is
rank 0 and spawns all the others. Not built yet (each refused with an error naming the
setting): PP with data parallelism, with LoRA, speculative decoding, torch.compile or CUDA graphs,
and for the models whose class does not say `supports_pp`.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from tokenwise import envs
from tokenwise.config import CUDAGraphMode, EngineConfig
from tokenwise.distributed.pp_state import (
    destroy_pp_group,
    init_pp_group,
    is_pp_initialized,
    pp_layer_partition,
)
from tokenwise.distributed.tp_launch import (
    TPWorkers,
    WorkerMain,
    launched_by_torchrun,
    startup_failures_named,
)
from tokenwise.distributed.tp_state import free_port


def _stage_models() -> list[str]:
    """The registered architectures whose model class runs as pipeline stages."""
    from tokenwise.models.registry import MODEL_REGISTRY

    return sorted(
        arch for arch, cls in MODEL_REGISTRY.items() if getattr(cls, "supports_pp", False)
    )


def check_pipeline_config(config: EngineConfig) -> None:
    """Raise ValueError, naming the setting, for a pipeline this slice cannot run."""
    parallel = config.parallel
    pp = parallel.pipeline_parallel_size
    if pp == 1:
        return
    model = config.model
    assert model is not None
    from tokenwise.models.registry import resolve_model_class

    archs = list(model.architectures or [])
    model_cls = resolve_model_class(archs)
    # A model class says whether its stack builds one stage's layers (`supports_pp`).
    if not getattr(model_cls, "supports_pp", False):
        raise ValueError(
            f"pipeline_parallel_size={pp} is not supported for "
            f"{', '.join(archs) or 'this model'} yet; models that run as pipeline stages: "
            f"{', '.join(_stage_models())}"
        )
    # The layers the stages split: the decoder's (`decoder_layers` of an encoder-decoder model).
    field = getattr(model_cls, "pp_layers_field", "num_hidden_layers")
    parts = pp_layer_partition(int(getattr(model.hf_config, field)), pp, field)
    # A family whose layers depend on each other across the stack (Gemma 4's KV sharing and
    # KV-cache kinds) refuses a split it cannot run, here, before any stage starts.
    check_split = getattr(model_cls, "check_pipeline_split", None)
    if check_split is not None:
        check_split(model.hf_config, parts)
    blocks, block_size = config.cache.num_gpu_blocks, config.cache.block_size
    needed = -(-model.max_model_len // block_size)
    if blocks is not None and blocks // pp < needed:
        raise ValueError(
            f"num_gpu_blocks={blocks} gives each of the {pp} virtual engines {blocks // pp} "
            f"blocks, fewer than one sequence of max_model_len={model.max_model_len} needs "
            f"({needed}): pipeline_parallel_size={pp} splits the KV cache {pp} ways, so give "
            f"num_gpu_blocks at least {needed * pp} or lower max_model_len"
        )
    # Data parallelism, drafts and LoRA are refused by the feature table
    # (`entrypoints/feature_rules.py`); what is left depends on the resolved graph mode.
    refusals = {
        "enforce_eager=False (torch.compile)": config.compilation.use_compile,
        "cudagraph_mode": config.compilation.cudagraph_mode != CUDAGraphMode.NONE,
    }
    for setting, refused in refusals.items():
        if refused:
            raise ValueError(
                f"pipeline_parallel_size={pp} does not combine with {setting} yet; "
                "run the pipeline eagerly (enforce_eager=True, cudagraph_mode NONE)"
            )


def torchrun_pp_rank(config: EngineConfig) -> int | None:
    """This process's global rank when torchrun launched a pipeline-parallel run, else None.

    torchrun must start exactly `pipeline_parallel_size * tensor_parallel_size` processes
    (e.g. `--nnodes P --nproc-per-node T`: a stage per machine, TP within it)."""
    parallel = config.parallel
    if parallel.pipeline_parallel_size == 1 or not launched_by_torchrun():
        return None
    world = parallel.pipeline_parallel_size * parallel.tensor_parallel_size
    if int(envs.external("WORLD_SIZE") or 0) != world:
        raise ValueError(
            f"torchrun started {envs.external('WORLD_SIZE')} processes, but "
            f"pipeline_parallel_size * tensor_parallel_size is {world}: start that many"
        )
    return int(envs.external("RANK") or 0)


def _stage_namer(tp_size: int) -> Callable[[int], str]:
    """How errors name a spawned process: its stage (and TP rank under PP x TP)."""
    if tp_size == 1:
        return lambda rank: f"pipeline stage {rank}"
    return lambda rank: f"pipeline stage {rank // tp_size} TP rank {rank % tp_size}"


def start_pipeline_parallel(
    config: EngineConfig,
    worker_main: WorkerMain | None,
    launcher: type[TPWorkers] | None = None,
) -> TPWorkers | None:
    """Check the settings, then (on the driver) spawn the other stages and join the group.

    Called before the model is built: the model reads its layer range at construction.
    Returns the spawned stages on the driver; None with P = 1 and in a spawned stage, which
    joined the group before building its runner. `worker_main(config, rank, init_method)` is
    the stages' entry (`tokenwise.executor.worker_main.run_pp_worker`, above the runner);
    `launcher` starts them (default `TPWorkers`: spawned processes).
    """
    check_pipeline_config(config)
    parallel = config.parallel
    pp = parallel.pipeline_parallel_size
    if pp == 1 or is_pp_initialized():
        return None
    tp = parallel.tensor_parallel_size
    if torchrun_pp_rank(config) is not None:  # rank 0: the other ranks are stages already
        limit_cpu_threads(config)
        init_pp_group(pp, tp, 0, 0, None, config.device)
        return None
    if worker_main is None:
        raise ValueError(
            f"pipeline_parallel_size={pp} needs the stage entry point to spawn stages: build "
            "the runner through LLMEngine"
        )
    limit_cpu_threads(config)
    init_method = f"tcp://127.0.0.1:{free_port()}"
    workers = (launcher or TPWorkers)(
        config, init_method, worker_main, pp * tp, describe=_stage_namer(tp)
    )
    with startup_failures_named(workers):
        try:
            init_pp_group(pp, tp, 0, 0, workers.init_method, config.device, workers)
        except BaseException:
            destroy_pp_group()
            raise
    return workers


def limit_cpu_threads(config: EngineConfig) -> None:
    """P stages on one CPU share its cores instead of each claiming all of them."""
    if str(config.device).startswith("cuda") or envs.external("OMP_NUM_THREADS") is not None:
        return
    processes = config.parallel.pipeline_parallel_size * config.parallel.tensor_parallel_size
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // processes))
