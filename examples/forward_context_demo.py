"""The forward context in ten lines: a layer reads batch state that `forward` never receives."""

import torch

from tokenwise.config import EngineConfig
from tokenwise.forward_context import get_forward_context, set_forward_context


class CountingLayer(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()  # installed by the engine for this pass only
        print(f"layer sees {ctx.attn_metadata['num_seqs']} sequences, {x.shape[0]} tokens")
        return x


layer, config = CountingLayer(), EngineConfig()
with set_forward_context({"num_seqs": 3}, config, num_tokens=7):
    layer(torch.zeros(7, 4))  # -> layer sees 3 sequences, 7 tokens
