"""The gated activation of SwiGLU MLPs, applied to the fused gate_up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """`silu(gate) * up` where the input is `[..., 2 * d]` laid out as `[gate | up]`.

    Taking the fused tensor (instead of two) is what lets gate and up share one matmul.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


def get_act_and_mul(hidden_act: str) -> nn.Module:
    """The gated activation named by a HF config's `hidden_act`."""
    if hidden_act in ("silu", "swish"):
        return SiluAndMul()
    raise NotImplementedError(f"hidden_act {hidden_act!r} is not supported (supported: silu)")
