"""Recurrent-state layers in replayed CPU graphs: the decode step's slots as persistent input.

A FULL graph replays a decode step of a hybrid model (Gated DeltaNet layers beside attention)
from recorded kernel calls (`compilation/cpu_graph.py`). Attention reads its block tables and
slot mapping from the input batch's persistent buffers; a recurrent layer's decode kernel
(`native.gdn_decode.gated_delta_decode_step`) reads, the same way, two int64 buffers held
here: the token row of each request (0..n-1 in a decode step) and its live state slot. The
graph is captured on `RecurrentMetadata` that carries these buffers (`graph_rows`,
`graph_slots`); before each replay `prepare` writes the step's slots into them (the plan's,
padding rows on the scratch slot, as eagerly).

Capture runs the forward three times (warm-up, recording, check replay) and the check needs
each run to compute the same output: the capture slots are -1, which the kernel reads as a
zero state and never writes, so the runs agree and no slot is touched. The state copies of a
step (a new request's zeroing, a prefix hit's snapshot restored, a block's snapshot taken) stay
outside the replayed forward: the runner's `RecurrentStates` does them before and after it.

On CUDA recurrent layers still run eagerly (their torch decode step builds index tensors from
host lists, which a CUDA graph would freeze); only CPU graphs take them.
"""

from __future__ import annotations

from typing import Any

import torch

from tokenwise.attention.recurrent import RecurrentMetadata
from tokenwise.distributed.step_message import StatePlan

# The slot capture runs with: a zero state, never written (see the module).
CAPTURE_SLOT = -1


class RecurrentGraphInputs:
    """The persistent slot buffers of the recurrent layers' graph steps, for sizes up to
    `max_size` rows."""

    def __init__(self, layer_names: tuple[str, ...], max_size: int) -> None:
        self.layer_names = layer_names
        self.rows = torch.arange(max_size, dtype=torch.int64)
        self.slots = torch.full((max_size,), CAPTURE_SLOT, dtype=torch.int64)
        self._metadata: dict[int, RecurrentMetadata] = {}

    def metadata(self, size: int) -> dict[str, RecurrentMetadata]:
        """The recurrent layers' metadata for a graph of `size` decode rows (the same object
        for capture and every replay: its buffers are what the recorded calls read)."""
        if not 0 < size <= len(self.slots):
            raise ValueError(f"graph size {size} outside [1, {len(self.slots)}]")
        md = self._metadata.get(size)
        if md is None:
            md = RecurrentMetadata(
                [CAPTURE_SLOT] * size,
                list(range(size + 1)),
                [False] * size,
                graph_rows=self.rows[:size],
                graph_slots=self.slots[:size],
            )
            self._metadata[size] = md
        return {name: md for name in self.layer_names}

    def capturing(self) -> None:
        """Point every row at the capture slot (before graphs are recorded)."""
        self.slots.fill_(CAPTURE_SLOT)

    def prepare(self, plan: StatePlan) -> None:
        """Write a padded decode step's live slots (`plan.slots`, one per row) for its replay."""
        n = len(plan.slots)
        if n > len(self.slots) or plan.starts != list(range(n + 1)) or any(plan.keep):
            raise ValueError(
                f"a graph step must be {len(self.slots)} decode rows at most, one token each "
                f"and none keeping token states; got starts {plan.starts}"
            )
        self.slots[:n] = torch.tensor(plan.slots, dtype=torch.int64)


def attach_recurrent_inputs(graph_runner: Any, recurrent: Any) -> None:
    """Give `graph_runner` (a `CUDAGraphRunner`) the slot buffers of the model's recurrent
    layers (`recurrent`: the runner's `RecurrentStates`, None without such layers)."""
    if recurrent is not None:
        size = max(graph_runner.capture_sizes)
        graph_runner.recurrent = RecurrentGraphInputs(recurrent.layer_names, size)


__all__ = ["CAPTURE_SLOT", "RecurrentGraphInputs", "attach_recurrent_inputs"]
