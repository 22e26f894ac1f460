"""The TP driver's side of the channel to its workers.

Each step the driver broadcasts the step's `StepMessage` (`step_message.py`: the flat inputs,
every KV-cache group's tables and slot mapping, the rows that sample, the LoRA adapters) as
bytes over the TP group's gloo channel; nothing about requests or sampling crosses.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from tokenwise.distributed.rendezvous import WorkerLostError, wait_polled
from tokenwise.distributed.tp_broadcast import broadcast_message, receive_message
from tokenwise.distributed.tp_launch import TPWorkers
from tokenwise.distributed.tp_state import (
    destroy_tp_group,
    get_tp_cpu_group,
    get_tp_rank,
    get_tp_size,
)


class TPDriver:
    """The runner's view of its TP group: broadcast steps (driver), receive them (workers),
    and name a dead worker when a collective fails. Inert with TP size 1."""

    def __init__(self, workers: TPWorkers | None) -> None:
        self.workers = workers
        self.active = get_tp_size() > 1
        self.is_driver = get_tp_rank() == 0
        self._stopped = False

    def broadcast(self, message: tuple) -> None:
        try:  # checking the workers while it is sent (`tp_broadcast`)
            broadcast_message(message, get_tp_cpu_group(), self.workers)
        except WorkerLostError as exc:
            self._fail(str(exc))

    def receive(self) -> tuple:
        return receive_message(get_tp_cpu_group())

    def agree_on_min(self, value: int) -> int:
        """The smallest of every TP rank's `value` (e.g. KV blocks: every rank needs as many)."""
        if not self.active:
            return value
        box = torch.tensor([value], dtype=torch.int64)
        work = dist.all_reduce(box, op=dist.ReduceOp.MIN, group=get_tp_cpu_group(), async_op=True)
        try:  # the driver checks its workers while they build their shards
            wait_polled(work, self.workers, "agreeing on the KV cache size")
        except WorkerLostError:
            self.abandon()  # the other workers stop too; the groups are left
            raise
        return int(box.item())

    def check_workers(self) -> None:
        if self.workers is not None:
            dead = self.workers.dead_worker()
            if dead is not None:
                self._fail(dead)

    @contextmanager
    def failures_named(self) -> Iterator[None]:
        """Turn a failed collective into an error naming the worker that caused it."""
        if not self.active:
            yield
            return
        try:
            yield
        except Exception as exc:
            if self.workers is not None:
                self.workers.procs[0].join(timeout=0.5)  # let a dying worker be seen as dead
                dead = self.workers.dead_worker()
                if dead is not None:
                    self._fail(f"{dead} ({type(exc).__name__}: {str(exc).splitlines()[0]})")
            raise RuntimeError(
                f"a tensor-parallel collective failed ({type(exc).__name__}: {exc}); a peer "
                "process has probably died, and the engine cannot continue"
            ) from exc

    def _fail(self, reason: str) -> None:
        assert self.workers is not None
        self.workers.kill()
        self.workers.join()  # reaped now: Ray actors free their placement group with it
        self._stopped = True
        destroy_tp_group()
        raise RuntimeError(f"{reason}; the engine cannot continue")

    def abandon(self) -> None:
        """Stop spawned workers without a word (the driver cannot go on)."""
        self._stopped = True
        if self.workers is not None:
            self.workers.kill()
            self.workers.join()
        destroy_tp_group()

    def stop(self) -> None:
        """Tell the workers to leave their loop (driver only), once."""
        if not self.active or not self.is_driver or self._stopped:
            return
        self._stopped = True
        if self.workers is None or self.workers.dead_worker() is None:
            try:
                self.broadcast(("stop",))
            except Exception:  # a dead peer: nothing to stop there
                pass
        if self.workers is not None:
            self.workers.join()
        destroy_tp_group()  # the process may build another engine
