"""The target's hidden states that an EAGLE head reads, handed out per request after a step.

An EAGLE head proposes from the target's own features: EAGLE-1 from the last hidden state
(after the final norm: what the model returns), EAGLE-3 from the residual stream at the input
of three decoder layers. `TargetHiddenCapture` exists only when such a method is configured, so
a step without EAGLE pays nothing. For EAGLE-3 it puts a forward pre-hook on each of those
layers, which keeps `hidden + residual` (the layer's input, as the layer adds the residual
itself); under micro-batching a hook fires once per micro-batch, and the pieces are joined in
token order.

After a step, `collect` returns a `TargetHidden`: one row per token the step computed (for
EAGLE-3 the three layers' rows side by side, `3h` wide) and, per request, where its rows start
and which positions they are. The rows of drafts that verification rejects are there too; the
proposer keeps only the positions the request has computed when it next proposes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tokenwise.engine.step_outputs import ScheduledRequest


@dataclass
class HiddenSpan:
    """Rows `offset .. offset + count` of `TargetHidden.rows` are the request's positions
    `start .. start + count` (`generation`: its preemption count when they were computed)."""

    request_id: str
    generation: int
    start: int
    count: int
    offset: int


@dataclass
class TargetHidden:
    rows: torch.Tensor  # [num_tokens, width]
    spans: list[HiddenSpan]


class TargetHiddenCapture:
    """Captures the target features one EAGLE method needs (`aux_layers` None: the last)."""

    def __init__(self, model: nn.Module, aux_layers: tuple[int, ...] | None) -> None:
        self.aux_layers = aux_layers
        self._pieces: dict[int, list[torch.Tensor]] = {}
        if aux_layers is None:
            return
        layers = getattr(getattr(model, "model", None), "layers", None)
        if layers is None:
            raise ValueError(
                "speculative_config.method 'eagle3' needs a target with decoder layers at "
                f"model.layers; {type(model).__name__} has none"
            )
        for i in aux_layers:
            layers[i].register_forward_pre_hook(self._hook(i))

    def _hook(self, index: int) -> Any:
        def keep(module: nn.Module, args: tuple[Any, ...]) -> None:
            hidden = args[1]
            residual = args[2] if len(args) > 2 else None
            self._pieces.setdefault(index, []).append(
                hidden if residual is None else hidden + residual
            )

        return keep

    def begin(self) -> None:
        self._pieces = {}

    def collect(self, hidden: torch.Tensor, ordered: list[ScheduledRequest]) -> TargetHidden:
        """The step's rows (`hidden`: what the model returned) and each request's span."""
        num_tokens = sum(item.num_new_tokens for item in ordered)
        if self.aux_layers is None:
            rows = hidden[:num_tokens]
        else:
            per_layer = [torch.cat(self._pieces[i])[:num_tokens] for i in self.aux_layers]
            rows = torch.cat(per_layer, dim=-1)
            self._pieces = {}
        spans, offset = [], 0
        for item in ordered:
            spans.append(
                HiddenSpan(
                    item.req_id,
                    item.num_preemptions,
                    item.num_computed_tokens,
                    item.num_new_tokens,
                    offset,
                )
            )
            offset += item.num_new_tokens
        return TargetHidden(rows, spans)


__all__ = ["HiddenSpan", "TargetHidden", "TargetHiddenCapture"]
