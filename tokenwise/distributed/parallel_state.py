"""The data-parallel CPU process group.

DP ranks agree on each step's batch shape with a tiny all-reduce of a few integers. That traffic
is latency-bound and lives on the CPU, so it goes over its own gloo group rather than whatever
device backend the model uses: it never waits behind (or blocks) device kernels, and it works
on machines without an accelerator.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch.distributed import ProcessGroup

from tokenwise.config import ParallelConfig
from tokenwise.distributed.rendezvous import open_store

__all__ = [
    "destroy_dp_group",
    "get_dp_device_group",
    "get_dp_group",
    "init_dp_group",
    "is_dp_group_initialized",
]

_dp_group: ProcessGroup | None = None
# The group MoE layers exchange activations over: the gloo group itself on CPU, an NCCL group
# over the same ranks when the model runs on CUDA (gloo cannot move device tensors).
_dp_device_group: ProcessGroup | None = None
# (data_parallel_size, data_parallel_rank) the group was built for: a second init with a
# different layout is a bug in the caller, not something to silently ignore.
_dp_layout: tuple[int, int] | None = None
# True when init_dp_group created the default group itself and must therefore tear it down.
_owns_default_group: bool = False


def init_dp_group(
    parallel_config: ParallelConfig,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    timeout_s: float = 60.0,
    device: str = "cpu",
) -> None:
    """Create the DP gloo group once; later calls with the same layout are no-ops.

    Without a default process group, one is created over the DP ranks only (world size =
    data_parallel_size), rendezvousing over TCP at master_addr:master_port. When the caller has
    already initialised torch.distributed (e.g. for DP x TP), global ranks are assumed to be laid
    out as `dp_rank * tensor_parallel_size + tp_rank`, and this rank joins the gloo group of the
    ranks sharing its TP rank. `new_group` is collective, so every rank creates every group.
    `master_port` has no default because a fixed port collides between concurrent jobs; it is
    only needed when this call creates the default group.
    """
    global _dp_group, _dp_layout, _owns_default_group, _dp_device_group
    dp_size = parallel_config.data_parallel_size
    dp_rank = parallel_config.data_parallel_rank
    if _dp_group is not None:
        if _dp_layout != (dp_size, dp_rank):
            raise RuntimeError(
                f"DP group already initialised for (size, rank) = {_dp_layout}, cannot "
                f"re-initialise it for {(dp_size, dp_rank)}; call destroy_dp_group() first"
            )
        return
    timeout = timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        if master_port is None:
            raise ValueError(
                "init_dp_group needs master_port (the TCP rendezvous port, the same on every "
                "DP rank) when torch.distributed is not initialised yet"
            )
        # Our own store, not init_method's: that one listens on every interface.
        store = open_store(master_addr, master_port, dp_size, dp_rank == 0, timeout)
        dist.init_process_group(
            backend="gloo", store=store, world_size=dp_size, rank=dp_rank, timeout=timeout
        )
        _owns_default_group = True
        _dp_group = dist.group.WORLD
    else:
        _dp_group = _new_dp_subgroup(parallel_config, timeout)
        _owns_default_group = False
    _dp_device_group = _dp_group
    if str(device).startswith("cuda"):
        ranks = dist.get_process_group_ranks(_dp_group)
        _dp_device_group = dist.new_group(ranks=ranks, backend="nccl", timeout=timeout)
    _dp_layout = (dp_size, dp_rank)


def _new_dp_subgroup(parallel_config: ParallelConfig, timeout: timedelta) -> ProcessGroup:
    dp_size = parallel_config.data_parallel_size
    tp_size = parallel_config.tensor_parallel_size
    world, me = dist.get_world_size(), dist.get_rank()
    if world != dp_size * tp_size:
        raise ValueError(
            f"existing process group has world size {world}, expected data_parallel_size * "
            f"tensor_parallel_size = {dp_size} * {tp_size}"
        )
    if me // tp_size != parallel_config.data_parallel_rank:
        raise ValueError(
            f"global rank {me} implies DP rank {me // tp_size} (layout dp_rank * tp_size + "
            f"tp_rank), but data_parallel_rank is {parallel_config.data_parallel_rank}"
        )
    mine: ProcessGroup | None = None
    for tp_rank in range(tp_size):
        ranks = [d * tp_size + tp_rank for d in range(dp_size)]
        group = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
        if tp_rank == me % tp_size:
            mine = group
    assert mine is not None
    return mine


def is_dp_group_initialized() -> bool:
    return _dp_group is not None


def get_dp_group() -> ProcessGroup:
    if _dp_group is None:
        raise RuntimeError(
            "The data-parallel group is not initialised. Call "
            "tokenwise.distributed.init_dp_group(parallel_config, master_addr=..., "
            "master_port=...) on every DP rank before running a step with "
            "data_parallel_size > 1."
        )
    return _dp_group


def get_dp_device_group() -> ProcessGroup:
    """The DP group for activations (on the model's device); see `init_dp_group(device=...)`."""
    if _dp_device_group is None:
        get_dp_group()  # raises the explanatory error
    assert _dp_device_group is not None
    return _dp_device_group


def destroy_dp_group() -> None:
    """Tear down the DP group (and the default group if this module created it)."""
    global _dp_group, _dp_layout, _owns_default_group, _dp_device_group
    if _dp_group is None:
        return
    if dist.is_initialized():
        if _dp_device_group is not None and _dp_device_group is not _dp_group:
            dist.destroy_process_group(_dp_device_group)
        if _owns_default_group:
            dist.destroy_process_group()
        else:
            dist.destroy_process_group(_dp_group)
    _dp_group, _dp_layout, _owns_default_group = None, None, False
    _dp_device_group = None
