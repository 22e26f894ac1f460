"""The tensor-parallel process groups, and the two collectives TP layers need.

Layers read their TP rank and size from here at construction (as in vLLM), so model code never
passes them around: `get_tp_size()` is 1 until `init_tp_group` runs, which makes every parallel
layer an ordinary layer in a single process. Two groups are kept: the one activations are
reduced over (gloo on CPU, NCCL on CUDA), and a gloo group with a very long timeout over which
the driver broadcasts each step's inputs: workers wait there for as long as the engine idles
(a dead driver still wakes them at once: gloo fails a wait when its peer's socket closes).
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.distributed_c10d import _set_pg_timeout

from tokenwise.distributed.rendezvous import (
    Liveness,
    open_rendezvous,
    wait_for_arrivals,
    worker_start_timeout_s,
)

__all__ = [
    "abort_join",
    "destroy_tp_group",
    "free_port",
    "get_tp_cpu_group",
    "get_tp_group",
    "get_tp_rank",
    "get_tp_size",
    "init_tp_group",
    "is_tp_initialized",
    "join_world",
    "new_group_bounded",
    "tp_all_gather",
    "tp_all_reduce",
]

# A collective over activations waits this long for a slow peer (a long prefill elsewhere).
ACTIVATION_TIMEOUT_S = 300.0
IDLE_TIMEOUT = timedelta(days=365)  # workers wait for the next step as long as the engine idles

_tp_group: ProcessGroup | None = None
_tp_cpu_group: ProcessGroup | None = None
_tp_rank, _tp_size = 0, 1
_owns_default_group = False


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now, for a rendezvous the engine sets up itself."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def join_world(
    world: int,
    rank: int,
    init_method: str | None,
    device: str,
    workers: Liveness | None = None,
) -> bool:
    """Join torch.distributed's default group as `rank` of `world`, unless already in one;
    True when this call created it (its owner destroys it). Shared by the TP and PP groups:
    gloo on CPU (NCCL too on CUDA), with the activation timeout. `init_method`: a spawned
    world's `tcp://` rendezvous, or None for torchrun's environment (MASTER_ADDR, RANK, ...).
    A spawned world meets at a store first (`rendezvous`): a process that spawned `workers`
    waits there, checking them, until every rank has arrived, so a dead or missing worker
    fails start-up at once (or after the start-up timeout) instead of after minutes."""
    if dist.is_initialized():
        return False
    cuda = str(device).startswith("cuda")
    backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    timeout = timedelta(seconds=ACTIVATION_TIMEOUT_S)
    if init_method is None:
        dist.init_process_group(
            backend=backend, init_method="env://", world_size=world, rank=rank, timeout=timeout
        )
        return True
    store = open_rendezvous(init_method, world, rank)
    if workers is not None:
        wait_for_arrivals(store, world, rank, workers, init_method)
    dist.init_process_group(
        backend=backend, store=store, world_size=world, rank=rank, timeout=timeout
    )
    return True


def new_group_bounded(
    ranks: list[int], timeout: timedelta = IDLE_TIMEOUT, backend: str | None = "gloo"
) -> ProcessGroup:
    """A process group whose operations wait `timeout` (by default as long as the engine
    idles: the step messages' gloo group), but whose forming waits only the start-up timeout:
    a peer that died before joining fails it within that instead of within `timeout`."""
    group = dist.new_group(
        ranks=ranks, backend=backend, timeout=timedelta(seconds=worker_start_timeout_s())
    )
    if dist.get_rank() in ranks:
        _set_pg_timeout(timeout, group)
    return group


def init_tp_group(
    tp_size: int,
    tp_rank: int,
    init_method: str | None = None,
    device: str = "cpu",
    dp_size: int = 1,
    dp_rank: int = 0,
    workers: Liveness | None = None,
) -> None:
    """Join the TP group as `tp_rank` of `tp_size` (every rank calls this; it is collective).

    `init_method` is a `tcp://host:port` rendezvous for processes the engine spawned; None means
    torch.distributed's environment (`torchrun` sets MASTER_ADDR, RANK, WORLD_SIZE, ...).
    Under data parallelism (`dp_size > 1`) the world holds `dp_size * tp_size` processes, global
    rank `dp_rank * tp_size + tp_rank`, and each DP rank's TP ranks form their own group.
    `workers`: the processes this one spawned, checked while it waits for them to arrive.
    """
    global _owns_default_group
    if _tp_group is not None:
        raise RuntimeError("the tensor-parallel group is already initialised")
    world = dp_size * tp_size
    if join_world(world, dp_rank * tp_size + tp_rank, init_method, device, workers):
        _owns_default_group = True
    try:
        _make_tp_groups(world, tp_size, tp_rank, dp_size, dp_rank)
    except BaseException:
        abort_join()
        raise


def _make_tp_groups(world: int, tp_size: int, tp_rank: int, dp_size: int, dp_rank: int) -> None:
    global _tp_group, _tp_cpu_group, _tp_rank, _tp_size
    if dist.get_world_size() != world:
        raise ValueError(
            f"torch.distributed has {dist.get_world_size()} processes, but tensor_parallel_size "
            f"is {tp_size} (launch one process per TP rank: torchrun --nproc-per-node {tp_size})"
        )
    if dp_size == 1:
        _tp_group = dist.group.WORLD
        _tp_cpu_group = new_group_bounded(list(range(tp_size)))
    else:
        # new_group is collective over the world: every process creates every DP rank's groups.
        for d in range(dp_size):
            ranks = [d * tp_size + t for t in range(tp_size)]
            group = new_group_bounded(ranks, timedelta(seconds=ACTIVATION_TIMEOUT_S), None)
            cpu_group = new_group_bounded(ranks)
            if d == dp_rank:
                _tp_group, _tp_cpu_group = group, cpu_group
    _tp_rank, _tp_size = tp_rank, tp_size


def is_tp_initialized() -> bool:
    return _tp_group is not None


def get_tp_rank() -> int:
    return _tp_rank


def get_tp_size() -> int:
    return _tp_size


def get_tp_group() -> ProcessGroup:
    if _tp_group is None:
        raise RuntimeError("the tensor-parallel group is not initialised (init_tp_group)")
    return _tp_group


def get_tp_cpu_group() -> ProcessGroup:
    if _tp_cpu_group is None:
        raise RuntimeError("the tensor-parallel group is not initialised (init_tp_group)")
    return _tp_cpu_group


def abort_join() -> None:
    """Undo a join that failed half-way: the default group this module created, if any, so
    that the next engine in this process starts from nothing."""
    global _owns_default_group
    if _owns_default_group and dist.is_initialized():
        dist.destroy_process_group()
    _owns_default_group = False


def destroy_tp_group() -> None:
    global _tp_group, _tp_cpu_group, _tp_rank, _tp_size, _owns_default_group
    if _tp_group is None:
        return
    if dist.is_initialized():
        dist.destroy_process_group(_tp_cpu_group)
        if _tp_group is not dist.group.WORLD:
            dist.destroy_process_group(_tp_group)
        if _owns_default_group:
            dist.destroy_process_group()
    _tp_group = _tp_cpu_group = None
    _tp_rank, _tp_size, _owns_default_group = 0, 1, False


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the TP ranks (identity with one rank)."""
    if _tp_size == 1:
        return x
    dist.all_reduce(x, group=get_tp_group())
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every TP rank's `x` along `dim`, in rank order (identity with one rank)."""
    if _tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_tp_size)]
    dist.all_gather(parts, x.contiguous(), group=get_tp_group())
    return torch.cat(parts, dim=dim)
