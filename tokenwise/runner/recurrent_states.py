"""The runner's part for recurrent-state layers: each step's metadata, and the state copies
around the forward pass.

The block manager decides which slot holds which request's live state and when a snapshot is
taken (`kv_cache.managers.RecurrentStateManager`); the scheduler's output carries that as
`ScheduledRequest.state_step`. This part carries it out on the cache tensors:

- before the forward pass, a request's live slot starts from zeros (no prefix hit) or from the
  snapshot its prefix hit names;
- after it, the live state is copied into the step's snapshot slot (a step that ended on a
  block boundary), for later prefix hits;
- after sampling, a request that verified drafts gets back the state after its last accepted
  token (the layers kept one per token of such requests): rejected drafts leave no trace.

Copies run over every recurrent layer's tensor. The driver plans a step's copies
(`StatePlan`) and sends the plan to its TP workers inside the step message; after sampling it
sends them the rollbacks (`("restore", pairs)`), so every rank keeps its shard of each state in
step. Under pipeline parallelism each virtual engine has its own copy of every state tensor
(`layer.kv_cache[k]`, its own slots from its own block manager); the driver plans with that
virtual engine's input batch and each stage does the copies for its own layers. Micro-batches
are refused for such models for now. On CPU their decode steps replay CPU graphs, which read
the live slots from `recurrent_graph.py`'s buffers (the copies here stay outside the replay).
"""

from __future__ import annotations

import numpy as np
import torch

from tokenwise.attention.layer import AttentionLayerBase
from tokenwise.attention.recurrent import RecurrentMetadata
from tokenwise.config import EngineConfig
from tokenwise.distributed.step_message import StatePlan
from tokenwise.distributed.tp_channel import TPDriver
from tokenwise.engine.step_outputs import ScheduledRequest
from tokenwise.kv_cache.layout import KVCacheLayout
from tokenwise.kv_cache.managers import ZERO_STATE
from tokenwise.runner.input_batch import InputBatch, StepInputs


class RecurrentStates:
    """State bookkeeping of the one recurrent-state group of a model (None without one)."""

    def __init__(
        self, group_id: int, layer_names: tuple[str, ...], layers: dict, batch: InputBatch
    ) -> None:
        self.group_id = group_id
        self.layer_names = layer_names
        self.layers = [layers[name] for name in layer_names]
        self.batch = batch
        if batch.add_kv_cache_group(1) != group_id:
            raise RuntimeError("the input batch's recurrent-state group must match the layout's")

    @classmethod
    def create(
        cls,
        layout: KVCacheLayout,
        layers: dict[str, AttentionLayerBase],
        batch: InputBatch,
        config: EngineConfig,
        dp_lockstep: bool,
    ) -> RecurrentStates | None:
        """The part for the layout's recurrent-state group (None without one); refuses the
        settings it does not support yet."""
        found = [(g, group) for g, group in enumerate(layout.groups) if group.spec.pool == "state"]
        if not found:
            return None
        if len(found) > 1:
            raise ValueError(
                f"the model has {len(found)} kinds of recurrent state (layers with different "
                "state sizes); one is supported"
            )
        parallel = config.parallel
        if parallel.enable_microbatching and dp_lockstep:
            raise ValueError("micro-batching is not supported for recurrent-state layers yet")
        g, group = found[0]
        return cls(g, group.layer_names, layers, batch)

    def _tensors(self, virtual_engine: int = 0) -> list[torch.Tensor]:
        return [layer.kv_cache[virtual_engine] for layer in self.layers]

    # ---- the driver: what this step does -------------------------------------------------

    def plan(self, step: StepInputs, batch: InputBatch | None = None) -> StatePlan:
        """This step's state work, from the scheduler's instructions (driver only; TP workers
        and later pipeline stages receive it in the step message). `batch`: the input batch
        the step was laid out in (a pipeline virtual engine's; default the runner's). Padding
        rows use the scratch slot past the last."""
        tables = (batch or self.batch).group_tables[self.group_id]
        scratch = self._tensors()[0].shape[0] - 1
        slots = [int(tables[int(row), 0]) for row in step.rows]
        init, snapshot = [], []
        for item, live in zip(step.scheduled, slots, strict=False):
            todo = item.state_step
            if todo is not None and todo.init is not None:
                init.append((live, -1 if todo.init == ZERO_STATE else todo.init))
            if todo is not None and todo.snapshot is not None:
                snapshot.append((live, todo.snapshot))
        keep = [bool(s.spec_token_ids) for s in step.scheduled]
        pad = step.num_reqs - len(slots)
        starts = np.concatenate([[0], np.cumsum(step.query_lens_np)]).tolist()
        return StatePlan(slots + [scratch] * pad, starts, keep + [False] * pad, init, snapshot)

    def restores(
        self,
        step: StepInputs,
        plan: StatePlan,
        sampled: list[ScheduledRequest],
        token_ids: list[list[int]],
    ) -> list[tuple[int, int]]:
        """(live slot, token of this step) for each verifying request: the state to keep is
        the one after its last known token plus the drafts it accepted."""
        emitted = {id(s): len(t) for s, t in zip(sampled, token_ids, strict=True)}
        pairs = []
        for i, item in enumerate(step.scheduled):
            if item.spec_token_ids and id(item) in emitted:
                known = item.num_new_tokens - len(item.spec_token_ids)
                token = plan.starts[i] + known - 1 + emitted[id(item)] - 1
                pairs.append((plan.slots[i], token))
        return pairs

    # ---- every rank: doing it ----------------------------------------------------------------

    def begin(self, plan: StatePlan, virtual_engine: int = 0) -> dict[str, RecurrentMetadata]:
        """Start new live states (zeros, or a prefix hit's snapshot); the step's metadata."""
        for live, source in plan.init:
            for t in self._tensors(virtual_engine):
                if source < 0:
                    t[live].zero_()
                else:
                    t[live].copy_(t[source])
        self._last = RecurrentMetadata(list(plan.slots), list(plan.starts), list(plan.keep))
        return {name: self._last for name in self.layer_names}

    def finish(self, plan: StatePlan, virtual_engine: int = 0) -> None:
        """Copy each finished block's state into its snapshot slot."""
        for live, dst in plan.snapshot:
            for t in self._tensors(virtual_engine):
                t[dst].copy_(t[live])

    def restore(self, pairs: list[tuple[int, int]], tp: TPDriver | None = None) -> None:
        """Roll verifying requests back: live slot <- the state after the given token of the
        last step (the layers kept one per token of those requests); with `tp` (the driver
        of a TP group), on every worker too."""
        if not pairs:
            return
        if tp is not None:
            tp.broadcast(("restore", pairs))
        kept = self._last.token_states
        for live, token in pairs:
            for name, t in zip(self.layer_names, self._tensors(), strict=True):
                t[live].copy_(kept[name][token])


__all__ = ["RecurrentStates"]
