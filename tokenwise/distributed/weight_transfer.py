"""Named tensors from a trainer into a running engine, over a process group of their own.

RL frameworks train in one set of processes and sample rollouts from an inference engine in
another; after each step the trainer pushes its new weights into the engine without restarting
it. The group is separate from the engine's own (it has its own store and its own gloo
backend, so the engine's tensor-parallel group is untouched): the trainer is rank 0 and hosts
the store, and the engine's tensor-parallel rank r joins as rank 1 + r, so `world_size` is
1 + tensor_parallel_size.

The wire, all broadcasts from rank 0: the header's length (one int64), the header (JSON bytes:
each tensor's name, dtype and shape, in sending order), then each tensor. Every engine rank
receives every tensor whole and hands it to its model's loader, which keeps the rank's shard:
tensor-parallel layers are sharded on receive, and only one received tensor is held at a time.

Trainer side (`WeightSender`):

    sender = WeightSender("127.0.0.1", 29600, world_size=1 + tp)  # while the engine joins
    sender.send(model.named_parameters())                           # while the engine receives
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

# How long joining, and each tensor's broadcast, may take before it fails with an error.
DEFAULT_TIMEOUT_S = 120.0
_STORE_PREFIX = "tokenwise-weight-transfer"
_DTYPES = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64)
}


def join_weight_group(
    host: str, port: int, rank: int, world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S
) -> dist.ProcessGroupGloo:
    """Join (rank 0: host) the trainer-engine group; returns once every rank has joined, or
    raises after `timeout_s`."""
    if world_size < 2:
        raise ValueError(
            f"world_size must be at least 2 (a trainer and an engine rank), got {world_size}"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the group's world_size={world_size}")
    timeout = timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(
            host, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False
        )
        store = dist.PrefixStore(_STORE_PREFIX, store)
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    except RuntimeError as exc:  # DistNetworkError, DistStoreError: a timeout or a refusal
        raise RuntimeError(
            f"could not join the weight-transfer group at {host}:{port} as rank {rank} of "
            f"{world_size} within {timeout_s:g} s (is the trainer's WeightSender started, and "
            f"world_size 1 + tensor_parallel_size?): {exc}"
        ) from exc


def _broadcast(group: dist.ProcessGroupGloo, tensor: torch.Tensor, what: str) -> None:
    try:
        group.broadcast(tensor, 0).wait()
    except RuntimeError as exc:
        raise RuntimeError(f"weight transfer: broadcasting {what} failed: {exc}") from exc


class WeightSender:
    """The trainer's end: rank 0 of the group, which sends named tensors to every engine rank."""

    def __init__(
        self, host: str, port: int, world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> None:
        self.group = join_weight_group(host, port, 0, world_size, timeout_s)

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Send the tensors (HF checkpoint names); returns how many were sent."""
        tensors = [(name, t.detach().to("cpu").contiguous()) for name, t in named_tensors]
        for name, tensor in tensors:
            if str(tensor.dtype).removeprefix("torch.") not in _DTYPES:
                raise ValueError(f"tensor {name!r} has dtype {tensor.dtype}, which is not sent")
        header = json.dumps(
            [
                {"name": n, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
                for n, t in tensors
            ]
        ).encode()
        _broadcast(self.group, torch.tensor([len(header)], dtype=torch.int64), "the header size")
        _broadcast(self.group, torch.frombuffer(bytearray(header), dtype=torch.uint8), "the header")
        for name, tensor in tensors:
            _broadcast(self.group, tensor, repr(name))
        return len(tensors)

    def close(self) -> None:
        self.group = None  # type: ignore[assignment]


def receive_weights(group: dist.ProcessGroupGloo) -> Iterator[tuple[str, torch.Tensor]]:
    """An engine rank's end: yields each tensor as it arrives (receive the next one by asking
    for it; `drain` the rest if loading stops half-way, so the trainer is not left waiting)."""
    size = torch.zeros(1, dtype=torch.int64)
    _broadcast(group, size, "the header size")
    header = torch.empty(int(size.item()), dtype=torch.uint8)
    _broadcast(group, header, "the header")
    for entry in json.loads(bytes(header.numpy())):
        tensor = torch.empty(entry["shape"], dtype=_DTYPES[entry["dtype"]])
        _broadcast(group, tensor, repr(entry["name"]))
        yield entry["name"], tensor


def drain(received: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Receive (and drop) whatever of a transfer is left."""
    for _ in received:
        pass
