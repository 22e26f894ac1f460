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

Copies run over every recurrent layer's tensor. Tensor parallelism, pipeline stages and graphs
are refused for such models for now (`check_supported`), so the driver is the only process.
"""

from __future__ import annotations

import numpy as np
import torch

from tokenwise.attention.layer import AttentionLayerBase
from tokenwise.attention.recurrent import RecurrentMetadata
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
        cls, layout: KVCacheLayout, layers: dict[str, AttentionLayerBase], batch: InputBatch
    ) -> RecurrentStates | None:
        found = [(g, group) for g, group in enumerate(layout.groups) if group.spec.pool == "state"]
        if not found:
            return None
        if len(found) > 1:
            raise ValueError(
                f"the model has {len(found)} kinds of recurrent state (layers with different "
                "state sizes); one is supported"
            )
        g, group = found[0]
        return cls(g, group.layer_names, layers, batch)

    @staticmethod
    def check_supported(tp_size: int, pp_size: int, dp_ubatch: bool) -> None:
        for name, size in (("tensor_parallel_size", tp_size), ("pipeline_parallel_size", pp_size)):
            if size > 1:
                raise ValueError(
                    f"{name}={size} is not supported for models with recurrent-state layers "
                    "yet; run them with 1"
                )
        if dp_ubatch:
            raise ValueError("micro-batching is not supported for recurrent-state layers yet")

    def _tensors(self) -> list[torch.Tensor]:
        return [layer.kv_cache[0] for layer in self.layers]

    def _live_slot(self, row: int) -> int:
        return int(self.batch.group_tables[self.group_id][row, 0])

    def metadata(self, step: StepInputs) -> dict[str, RecurrentMetadata]:
        """This step's metadata for every recurrent layer (one object); padding rows use the
        scratch slot past the last real one."""
        scratch = self._tensors()[0].shape[0] - 1
        slots = [self._live_slot(int(row)) for row in step.rows]
        slots += [scratch] * (step.num_reqs - len(slots))
        keep = [bool(s.spec_token_ids) for s in step.scheduled]
        keep += [False] * (step.num_reqs - len(keep))
        starts = np.concatenate([[0], np.cumsum(step.query_lens_np)]).tolist()
        md = RecurrentMetadata(slots, starts, keep)
        return {name: md for name in self.layer_names}

    def before_forward(self, step: StepInputs) -> None:
        """Start new live states: from zeros, or from the snapshot of a prefix hit."""
        for item, row in zip(step.scheduled, step.rows, strict=False):
            init = item.state_step.init if item.state_step is not None else None
            if init is None:
                continue
            live = self._live_slot(int(row))
            for t in self._tensors():
                if init == ZERO_STATE:
                    t[live].zero_()
                else:
                    t[live].copy_(t[init])

    def after_forward(self, step: StepInputs) -> None:
        """Copy each finished block's state into its snapshot slot."""
        for item, row in zip(step.scheduled, step.rows, strict=False):
            snap = item.state_step.snapshot if item.state_step is not None else None
            if snap is None:
                continue
            live = self._live_slot(int(row))
            for t in self._tensors():
                t[snap].copy_(t[live])

    def after_sampling(
        self,
        step: StepInputs,
        md: dict[str, RecurrentMetadata],
        sampled: list[ScheduledRequest],
        token_ids: list[list[int]],
    ) -> None:
        """Roll each verifying request's state back to its last accepted token."""
        if not any(s.spec_token_ids for s in sampled):
            return
        emitted = {id(s): len(t) for s, t in zip(sampled, token_ids, strict=True)}
        one = md[self.layer_names[0]]
        for i, (item, row) in enumerate(zip(step.scheduled, step.rows, strict=False)):
            if not item.spec_token_ids or id(item) not in emitted:
                continue
            # The step ran its known tokens, then k drafts of which `emitted - 1` were
            # accepted: keep the state after the last known token plus those.
            known = item.num_new_tokens - len(item.spec_token_ids)
            token = one.query_start_loc[i] + known - 1 + emitted[id(item)] - 1
            live = self._live_slot(int(row))
            for layer, t in zip(self.layer_names, self._tensors(), strict=True):
                t[live].copy_(md[layer].token_states[layer][token])


__all__ = ["RecurrentStates"]
