"""Pipeline-parallel stages: which stage this process is, which layers it holds, its groups.

With `pipeline_parallel_size=P` the decoder layers are cut into P consecutive runs, one per
stage; stage 0 also holds the token embedding, the last stage the final norm and the LM head.
Models read `pp_layer_range` at construction (as parallel layers read their TP rank), so a
single process is stage 0 of 1 and holds everything.

The world is `P * T` processes (T = tensor_parallel_size), global rank `stage * T + tp_rank`
(vLLM's layout): each stage's T ranks form a TP group, and rank t of stage s sends its
activations to rank t of stage s + 1. Step messages travel over a gloo group with a very long
timeout, because a later stage waits there for as long as the engine idles (a dead peer still
wakes it at once: gloo fails a wait when the peer's socket closes); the default group, with the
activation timeout, carries the last stage's logits back to the engine.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed import ProcessGroup

from tokenwise import envs
from tokenwise.distributed.rendezvous import Liveness
from tokenwise.distributed.tp_state import (
    destroy_tp_group,
    init_tp_group,
    join_world,
    new_group_bounded,
)

__all__ = [
    "ENV_LAYER_PARTITION",
    "destroy_pp_group",
    "get_pp_idle_group",
    "get_pp_rank",
    "get_pp_size",
    "init_pp_group",
    "is_first_pp_stage",
    "is_last_pp_stage",
    "is_pp_initialized",
    "pp_layer_partition",
    "pp_layer_range",
    "stage_rank",
]

# vLLM's VLLM_PP_LAYER_PARTITION under our prefix: "4,4" gives stage 0 four layers, stage 1 four.
ENV_LAYER_PARTITION = "TOKENWISE_PP_LAYER_PARTITION"

_pp_rank, _pp_size, _tp_size = 0, 1, 1
_idle_group: ProcessGroup | None = None
_owns_default_group = False


def pp_layer_partition(
    num_layers: int, pp_size: int, field: str = "num_hidden_layers"
) -> list[int]:
    """How many decoder layers each stage holds, stage 0 first (`field`: the config field
    that counts them, for the errors; an encoder-decoder model splits its `decoder_layers`).

    From `TOKENWISE_PP_LAYER_PARTITION` when set (comma-separated, one count per stage, summing
    to the layer count); otherwise as even as possible, the remainder going one layer each to
    the stages just before the last (the last one also runs the LM head), as vLLM splits them.
    Every stage needs at least one layer.
    """
    if pp_size > num_layers:
        raise ValueError(
            f"pipeline_parallel_size ({pp_size}) exceeds the model's {field} "
            f"({num_layers}): every stage needs at least one layer"
        )
    text = envs.get(ENV_LAYER_PARTITION).strip()
    if not text:
        parts = [num_layers // pp_size] * pp_size
        for i in range(num_layers % pp_size):
            parts[pp_size - 2 - i] += 1
        return parts
    try:
        parts = [int(item) for item in text.split(",")]
    except ValueError:
        raise ValueError(
            f"{ENV_LAYER_PARTITION}={text!r} is not a comma-separated list of layer counts"
        ) from None
    if len(parts) != pp_size:
        raise ValueError(
            f"{ENV_LAYER_PARTITION}={text!r} has {len(parts)} entries, but "
            f"pipeline_parallel_size is {pp_size}"
        )
    if sum(parts) != num_layers:
        raise ValueError(
            f"{ENV_LAYER_PARTITION}={text!r} sums to {sum(parts)} layers, but the model has "
            f"{field}={num_layers}"
        )
    if min(parts) < 1:
        raise ValueError(f"{ENV_LAYER_PARTITION}={text!r}: every stage needs at least one layer")
    return parts


def pp_layer_range(num_layers: int) -> tuple[int, int]:
    """`[start, end)`: the decoder layers this process's stage holds (all of them with P = 1)."""
    if _pp_size == 1:
        return 0, num_layers
    parts = pp_layer_partition(num_layers, _pp_size)
    start = sum(parts[:_pp_rank])
    return start, start + parts[_pp_rank]


def init_pp_group(
    pp_size: int,
    tp_size: int,
    pp_rank: int,
    tp_rank: int,
    init_method: str | None,
    device: str = "cpu",
    workers: Liveness | None = None,
) -> None:
    """Join the pipeline as `tp_rank` of stage `pp_rank` (collective over all P * T ranks).

    `init_method`: the spawned world's `tcp://` rendezvous, or None for torch.distributed's
    environment; `workers`: the stages this process spawned, checked while they arrive. With T > 1 each stage's TP group is made here too (the TP groups of a
    `dp * tp` world have the same layout, one group per stage instead of per DP rank).
    """
    global _pp_rank, _pp_size, _tp_size, _idle_group, _owns_default_group
    if _idle_group is not None:
        raise RuntimeError("the pipeline-parallel group is already initialised")
    world = pp_size * tp_size
    if join_world(world, pp_rank * tp_size + tp_rank, init_method, device, workers):
        _owns_default_group = True
    try:
        if dist.get_world_size() != world:
            raise ValueError(
                f"torch.distributed has {dist.get_world_size()} processes, but "
                f"pipeline_parallel_size * tensor_parallel_size is {pp_size} * {tp_size}"
            )
        _idle_group = new_group_bounded(list(range(world)))
        if tp_size > 1:
            init_tp_group(tp_size, tp_rank, None, device, dp_size=pp_size, dp_rank=pp_rank)
    except BaseException:  # leave nothing half-joined for the next engine of this process
        _idle_group = None
        if _owns_default_group and dist.is_initialized():
            dist.destroy_process_group()
        _owns_default_group = False
        raise
    _pp_rank, _pp_size, _tp_size = pp_rank, pp_size, tp_size


def is_pp_initialized() -> bool:
    return _idle_group is not None


def get_pp_rank() -> int:
    return _pp_rank


def get_pp_size() -> int:
    return _pp_size


def is_first_pp_stage() -> bool:
    return _pp_rank == 0


def is_last_pp_stage() -> bool:
    return _pp_rank == _pp_size - 1


def stage_rank(stage: int, tp_rank: int = 0) -> int:
    """The global rank of TP rank `tp_rank` of pipeline stage `stage`."""
    return stage * _tp_size + tp_rank


def get_pp_idle_group() -> ProcessGroup:
    if _idle_group is None:
        raise RuntimeError("the pipeline-parallel group is not initialised (init_pp_group)")
    return _idle_group


def destroy_pp_group() -> None:
    """Leave the pipeline (and the stage's TP group); the process may build another engine."""
    global _pp_rank, _pp_size, _tp_size, _idle_group, _owns_default_group
    if _idle_group is None:
        return
    destroy_tp_group()
    if dist.is_initialized():
        dist.destroy_process_group(_idle_group)
        if _owns_default_group:
            dist.destroy_process_group()
    _idle_group = None
    _pp_rank, _pp_size, _tp_size, _owns_default_group = 0, 1, 1, False
