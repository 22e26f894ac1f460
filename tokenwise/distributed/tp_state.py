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

__all__ = [
    "destroy_tp_group",
    "free_port",
    "get_tp_cpu_group",
    "get_tp_group",
    "get_tp_rank",
    "get_tp_size",
    "init_tp_group",
    "is_tp_initialized",
    "join_world",
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


def join_world(world: int, rank: int, init_method: str | None, device: str) -> bool:
    """Join torch.distributed's default group as `rank` of `world`, unless already in one;
    True when this call created it (its owner destroys it). Shared by the TP and PP groups:
    gloo on CPU (NCCL too on CUDA), with the activation timeout. `init_method`: a spawned
    world's `tcp://` rendezvous, or None for torchrun's environment (MASTER_ADDR, RANK, ...)."""
    if dist.is_initialized():
        return False
    cuda = str(device).startswith("cuda")
    dist.init_process_group(
        backend="cpu:gloo,cuda:nccl" if cuda else "gloo",
        init_method=init_method or "env://",
        world_size=world,
        rank=rank,
        timeout=timedelta(seconds=ACTIVATION_TIMEOUT_S),
    )
    return True


def init_tp_group(
    tp_size: int,
    tp_rank: int,
    init_method: str | None = None,
    device: str = "cpu",
    dp_size: int = 1,
    dp_rank: int = 0,
) -> None:
    """Join the TP group as `tp_rank` of `tp_size` (every rank calls this; it is collective).

    `init_method` is a `tcp://host:port` rendezvous for processes the engine spawned; None means
    torch.distributed's environment (`torchrun` sets MASTER_ADDR, RANK, WORLD_SIZE, ...).
    Under data parallelism (`dp_size > 1`) the world holds `dp_size * tp_size` processes, global
    rank `dp_rank * tp_size + tp_rank`, and each DP rank's TP ranks form their own group.
    """
    global _tp_group, _tp_cpu_group, _tp_rank, _tp_size, _owns_default_group
    if _tp_group is not None:
        raise RuntimeError("the tensor-parallel group is already initialised")
    world = dp_size * tp_size
    if join_world(world, dp_rank * tp_size + tp_rank, init_method, device):
        _owns_default_group = True
    if dist.get_world_size() != world:
        raise ValueError(
            f"torch.distributed has {dist.get_world_size()} processes, but tensor_parallel_size "
            f"is {tp_size} (launch one process per TP rank: torchrun --nproc-per-node {tp_size})"
        )
    if dp_size == 1:
        _tp_group = dist.group.WORLD
        _tp_cpu_group = dist.new_group(
            ranks=list(range(tp_size)), backend="gloo", timeout=IDLE_TIMEOUT
        )
    else:
        # new_group is collective over the world: every process creates every DP rank's groups.
        for d in range(dp_size):
            ranks = [d * tp_size + t for t in range(tp_size)]
            group = dist.new_group(ranks=ranks, timeout=timedelta(seconds=ACTIVATION_TIMEOUT_S))
            cpu_group = dist.new_group(ranks=ranks, backend="gloo", timeout=IDLE_TIMEOUT)
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
