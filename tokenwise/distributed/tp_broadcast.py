"""The TP driver's step messages (and its workers' replies), sent so that the driver never
waits on a dead worker.

Each message (a step's inputs, a dummy batch, stop) is pickled and broadcast over the TP
group's gloo channel as two tensors: its length, then its bytes. The driver starts each
broadcast asynchronously and waits for it while checking its workers (`rendezvous.wait_polled`):
a dead worker ends the wait at once, naming it, and a live one that stops taking messages ends
it after the activation timeout, instead of the channel's idle timeout (a year: workers must
wait that long for the next step, the driver must not). Workers receive with plain blocking
broadcasts: they wait as long as the engine idles, and their driver's death wakes them (its
socket closes) or ends them (`lifecycle.watch_parent`).
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from tokenwise.distributed.rendezvous import Liveness, wait_polled
from tokenwise.distributed.tp_state import ACTIVATION_TIMEOUT_S


def broadcast_message(
    message: Any, group: ProcessGroup, workers: Liveness | None, what: str = "sending a step"
) -> None:
    """Send `message` from rank 0 of `group` to the others (the driver's side)."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    length = torch.tensor([len(data)], dtype=torch.int64)
    body = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    for tensor in (length, body):
        work = dist.broadcast(tensor, group=group, group_src=0, async_op=True)
        wait_polled(work, workers, what, ACTIVATION_TIMEOUT_S)


def receive_message(group: ProcessGroup) -> Any:
    """The next message rank 0 of `group` sends (a worker's side; waits as long as needed)."""
    length = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(length, group=group, group_src=0)
    body = torch.empty(int(length.item()), dtype=torch.uint8)
    dist.broadcast(body, group=group, group_src=0)
    return pickle.loads(body.numpy().tobytes())


def gather_replies(
    message: Any,
    group: ProcessGroup,
    workers: Liveness | None = None,
    what: str = "gathering replies",
    timeout_s: float | None = None,
) -> list[Any]:
    """Every rank's `message`, in rank order; every rank of `group` calls it (a worker
    answering the driver, e.g. an RPC's result). Two all-gathers (the lengths, then the bytes
    padded to the longest), which keep running when a timed wait gives up, so the driver can
    check its workers while it waits (`wait_polled`): a dead one is named at once, a silent one
    after `timeout_s`. Workers pass no `workers` and wait plainly."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    size = dist.get_world_size(group)
    length = torch.tensor([len(data)], dtype=torch.int64)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    wait_polled(
        dist.all_gather(lengths, length, group=group, async_op=True), workers, what, timeout_s
    )
    longest = max(int(n.item()) for n in lengths)
    body = torch.zeros(longest, dtype=torch.uint8)
    body[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    bodies = [torch.empty(longest, dtype=torch.uint8) for _ in range(size)]
    wait_polled(dist.all_gather(bodies, body, group=group, async_op=True), workers, what, timeout_s)
    return [
        pickle.loads(b[: int(n.item())].numpy().tobytes())
        for b, n in zip(bodies, lengths, strict=True)
    ]
