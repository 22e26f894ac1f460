"""What the TP driver sends its workers each step, and the driver's side of that channel.

A worker has no scheduler and no requests: it needs exactly the step's flat inputs (token ids,
positions, slot mapping, lengths, the block tables of every attention spec) to build the same
attention metadata as the driver and run the same forward pass, plus which rows sample (it must
join the LM head's all-gather for them). These travel as host tensors in one object broadcast
over the TP group's gloo channel; nothing about requests or sampling crosses.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tokenwise.distributed.rendezvous import WorkerLostError, wait_polled
from tokenwise.distributed.step_messages import broadcast_message, receive_message
from tokenwise.distributed.tp_launch import TPWorkers
from tokenwise.distributed.tp_state import (
    destroy_tp_group,
    get_tp_cpu_group,
    get_tp_rank,
    get_tp_size,
)
from tokenwise.runner.input_batch import StepInputs

# Attention spec (sliding window or None) -> (block tables, first logical block of each row).
SpecTables = dict[int | None, tuple[torch.Tensor, list[int] | None]]


def step_payload(step: StepInputs, tables: SpecTables) -> dict[str, Any]:
    def host(t: torch.Tensor) -> torch.Tensor:
        return t.cpu()

    return {
        "num_reqs": step.num_reqs,
        "input_ids": host(step.input_ids),
        "positions": host(step.positions),
        "slot_mapping": host(step.slot_mapping),
        "seq_lens": host(step.seq_lens),
        "query_lens": step.query_lens_np,
        "context_lens": step.context_lens_np,
        "tables": {spec: (host(t), first) for spec, (t, first) in tables.items()},
        "logits_indices": step.logits_indices,
    }


def step_from_payload(
    payload: dict[str, Any], device: torch.device
) -> tuple[StepInputs, SpecTables]:
    def dev(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, non_blocking=True)

    tables = {spec: (dev(t), first) for spec, (t, first) in payload["tables"].items()}
    full_tables = tables.get(None, next(iter(tables.values())))[0]
    step = StepInputs(
        num_reqs=payload["num_reqs"],
        num_tokens=int(payload["input_ids"].shape[0]),
        input_ids=dev(payload["input_ids"]),
        positions=dev(payload["positions"]),
        slot_mapping=dev(payload["slot_mapping"]),
        seq_lens=dev(payload["seq_lens"]),
        block_tables=full_tables,
        rows=np.zeros(0, dtype=np.int64),
        query_lens_np=payload["query_lens"],
        context_lens_np=payload["context_lens"],
        logits_indices=payload["logits_indices"],
        sampled=[],
    )
    return step, tables


class TPDriver:
    """The runner's view of its TP group: broadcast steps (driver), receive them (workers),
    and name a dead worker when a collective fails. Inert with TP size 1."""

    def __init__(self, workers: TPWorkers | None) -> None:
        self.workers = workers
        self.active = get_tp_size() > 1
        self.is_driver = get_tp_rank() == 0
        self._stopped = False

    def broadcast(self, message: tuple) -> None:
        try:  # checking the workers while it is sent (`step_messages`)
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
