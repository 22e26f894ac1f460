"""torch.compile of a token-wise model.

The attention op `tokenwise::unified_attention` is a `torch.library` custom op with a fake
implementation, so Dynamo traces the whole model as one graph in which every attention call is a
single opaque node: nothing about batching, metadata or the KV cache is traced, and the same
compiled code serves every batch shape (the token dimension is dynamic). The pieces between
attention calls are what Inductor fuses (norms, rotary, activation, residual adds).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)


def compile_model(model: nn.Module) -> nn.Module:
    """Compile `model.forward` (dynamic in the number of tokens, no graph breaks allowed).

    The first call of each new shape class pays the compile; `compute_logits` and weight
    loading still reach the original module through the wrapper's attribute forwarding.
    """
    logger.info("compiling the model with torch.compile (dynamic token dimension)")
    return torch.compile(model, dynamic=True, fullgraph=True)
