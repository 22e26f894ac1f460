"""What a model needs to run as one stage of a pipeline (`tokenwise.distributed.pp_state`).

`StageAbsent` stands where a module of another stage would be (a decoder layer, the embedding,
the final norm, the LM head): it has no parameters, so the stage neither allocates nor loads
it, and the modules it does hold keep their checkpoint names and indices (`model.layers.5` on
the second stage is still layer 5). `IntermediateTensors` is what one stage hands the next:
the hidden states and the running residual, the latter not yet added (the next layer's norm
fuses the add).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn


class IntermediateTensors(NamedTuple):
    hidden_states: torch.Tensor
    residual: torch.Tensor


class StageAbsent(nn.Module):
    """A placeholder for a module another pipeline stage holds; calling it is a bug."""

    def forward(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("this module belongs to another pipeline stage")
