"""What pipeline stages send each other, over torch.distributed point-to-point.

Forward, stage s to stage s + 1 (rank t of one stage to rank t of the next), one message per
micro-batch: a pickled header `("step", virtual_engine, the encoded step message
(`step_message.py`), busy seconds so far of each stage before, layout)` (its length first,
then its bytes), then one flat tensor concatenating the `IntermediateTensors` the layout names,
each as `(field, shape)` in order: the hidden states, and the residual or Gemma 4's per-layer
inputs only where the family has them (a model without a residual stream sends one tensor, not
a dummy second). `("stop",)` ends the receiving stage's loop (it passes it on).
Back, the last stage to the driver: the logits of the rows that sample, after a small float64
header (rows, columns, then every stage's busy seconds so far).

Sends are `isend`s: a stage goes on to its next micro-batch while its previous one is on the
wire, which is what lets stage 0 compute batch k + 1 while stage 1 computes batch k. Every
receive is bounded: the driver's by the default group's activation timeout and by the stage
processes' liveness (a dead stage fails the receive at once and is named in the error); a later
stage waits for its next step as long as the engine idles, but not past its predecessor's death.
This is gloo on CPU; on CUDA the tensors go through host memory (the NCCL path is untested).
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tokenwise.distributed.pp_state import (
    destroy_pp_group,
    get_pp_idle_group,
    get_pp_rank,
    get_pp_size,
    stage_rank,
)
from tokenwise.distributed.tp_launch import STOP_TIMEOUT_S, TPWorkers
from tokenwise.distributed.tp_state import get_tp_rank
from tokenwise.layers.pipeline import IntermediateTensors

# A message received: (virtual engine, the encoded `StepMessage`, the activations, busy seconds
# per stage).
StageMessage = tuple[int, bytes, IntermediateTensors | None, list[float]]


class PipelineChannel:
    """One stage's links to its neighbours (and, on the last stage, back to the driver)."""

    def __init__(self, workers: TPWorkers | None, dtype: torch.dtype, hidden_size: int) -> None:
        self.workers = workers
        self.rank, self.size = get_pp_rank(), get_pp_size()
        self.is_first, self.is_last = self.rank == 0, self.rank == self.size - 1
        # Under PP x TP rank t of a stage talks to rank t of its neighbours; TP rank 0 of the
        # last stage sends the logits (every TP rank has them all after the LM head's gather).
        self.tp_rank = get_tp_rank()
        self.is_driver = self.is_first and self.tp_rank == 0  # the engine's process
        self.dtype, self.hidden_size = dtype, hidden_size
        self._sends: list[tuple[Any, torch.Tensor]] = []  # in flight: (work, tensor kept alive)
        self._stopped = False

    # ---- forward: stage to stage ----------------------------------------------------------

    def send_step(
        self,
        virtual_engine: int,
        payload: bytes,
        out: IntermediateTensors,
        busy: list[float],
    ) -> None:
        tensors = out.present()
        layout = [(name, tuple(t.shape)) for name, t in tensors.items()]
        header = pickle.dumps(("step", virtual_engine, payload, busy, layout))
        flat = [t.to("cpu", self.dtype).reshape(-1) for t in tensors.values()]
        activations = torch.cat(flat) if len(flat) > 1 else flat[0].contiguous()
        self._send_header(header)
        self._isend(activations, stage_rank(self.rank + 1, self.tp_rank))

    def recv_step(self) -> StageMessage | None:
        """The next micro-batch from the previous stage; None when told to stop."""
        group = get_pp_idle_group()
        src = stage_rank(self.rank - 1, self.tp_rank)
        length = torch.zeros(1, dtype=torch.int64)
        dist.recv(length, src=src, group=group)
        data = torch.empty(int(length.item()), dtype=torch.uint8)
        dist.recv(data, src=src, group=group)
        message = pickle.loads(data.numpy().tobytes())
        if message[0] == "stop":
            return None
        _, virtual_engine, payload, busy, layout = message
        sizes = [math.prod(shape) for _, shape in layout]
        activations = torch.empty(sum(sizes), dtype=self.dtype)
        dist.recv(activations, src=src, group=group)
        parts = activations.split(sizes)
        received = {name: p.view(shape) for (name, shape), p in zip(layout, parts, strict=True)}
        if received["hidden_states"].shape[-1] != self.hidden_size:
            raise RuntimeError(
                f"pipeline stage {self.rank - 1} sent hidden states of width "
                f"{received['hidden_states'].shape[-1]}, but this stage's model has "
                f"hidden_size={self.hidden_size}: every stage must load the same model"
            )
        return virtual_engine, payload, IntermediateTensors(**received), busy

    def _send_header(self, header: bytes) -> None:
        dst = stage_rank(self.rank + 1, self.tp_rank)
        self._isend(torch.tensor([len(header)], dtype=torch.int64), dst)
        self._isend(torch.frombuffer(bytearray(header), dtype=torch.uint8), dst)

    def _isend(self, tensor: torch.Tensor, dst: int) -> None:
        self._sends = [(w, t) for w, t in self._sends if not w.is_completed()]
        work = dist.isend(tensor, dst=dst, group=get_pp_idle_group())
        self._sends.append((work, tensor))

    # ---- back: the last stage's logits to the driver ---------------------------------------

    def send_logits(self, logits: torch.Tensor, busy: list[float]) -> None:
        if self.tp_rank != 0:
            return
        logits = logits.to("cpu", torch.float32).contiguous()
        header = torch.tensor([*logits.shape, *busy], dtype=torch.float64)
        for tensor in (header, logits):
            work = dist.isend(tensor, dst=stage_rank(0))
            self._sends = [(w, t) for w, t in self._sends if not w.is_completed()]
            self._sends.append((work, tensor))

    def recv_logits(self) -> tuple[torch.Tensor, list[float]]:
        """The last stage's logits for the oldest micro-batch in flight, and the stages' busy
        seconds so far. Blocks at most the activation timeout; a dead stage fails it sooner."""
        src = stage_rank(self.size - 1)
        header = torch.zeros(2 + self.size, dtype=torch.float64)
        dist.recv(header, src=src)
        rows, cols = int(header[0]), int(header[1])
        logits = torch.empty((rows, cols), dtype=torch.float32)
        dist.recv(logits, src=src)
        return logits, header[2:].tolist()

    # ---- failures and shutdown -------------------------------------------------------------

    def check_stages(self) -> None:
        """Fail with an error naming a stage process that has exited (driver only)."""
        if self.workers is not None:
            dead = self.workers.dead_worker()
            if dead is not None:
                self._fail(dead)

    @contextmanager
    def failures_named(self) -> Iterator[None]:
        """Turn a failed send or receive into an error naming the stage that caused it."""
        try:
            yield
        except Exception as exc:
            first = str(exc).splitlines()[0] if str(exc) else ""
            if self.workers is not None:
                for proc in self.workers.procs:
                    proc.join(timeout=0.5 / len(self.workers.procs))
                dead = self.workers.dead_worker()
                if dead is not None:
                    self._fail(f"{dead} ({type(exc).__name__}: {first})")
            raise RuntimeError(
                f"a pipeline-parallel transfer failed ({type(exc).__name__}: {first}); a stage "
                "has probably died, and the engine cannot continue"
            ) from exc

    def _fail(self, reason: str) -> None:
        assert self.workers is not None
        self.workers.kill()
        self.workers.join()  # reaped now: Ray actors free their placement group with it
        self._stopped = True
        destroy_pp_group()
        raise RuntimeError(f"{reason}; the engine cannot continue")

    def forward_stop(self) -> None:
        """Pass the stop on to the next stage (nothing to do on the last)."""
        if not self.is_last:
            self._send_header(pickle.dumps(("stop",)))
        for work, _ in self._sends:  # bounded: a stuck peer must not hold the shutdown
            work.wait(timeout=timedelta(seconds=STOP_TIMEOUT_S))
        self._sends.clear()

    def stop(self) -> None:
        """Driver: stop every stage (each passes it on), wait for them, leave the group. Once."""
        if self._stopped or not self.is_driver:
            return
        self._stopped = True
        if self.workers is None or self.workers.dead_worker() is None:
            try:
                self.forward_stop()
            except Exception:  # a dead stage: nothing to stop there
                pass
        if self.workers is not None:
            self.workers.join()
        destroy_pp_group()

    def abandon(self) -> None:
        """Kill the spawned stages without a word (the driver cannot go on)."""
        self._stopped = True
        if self.workers is not None:
            self.workers.kill()
            self.workers.join()
        destroy_pp_group()
