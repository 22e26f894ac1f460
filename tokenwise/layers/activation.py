"""Activations: the gated one of SwiGLU MLPs (on the fused gate_up projection), and the plain
ones of encoder MLPs (BERT's GELU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenwise.native import fused as cpu_fused


class SiluAndMul(nn.Module):
    """`silu(gate) * up` where the input is `[..., 2 * d]` laid out as `[gate | up]`.

    Taking the fused tensor (instead of two) is what lets gate and up share one matmul.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = cpu_fused.silu_and_mul(x)  # decode-sized CPU rows: one C call
        if out is not None:
            return out
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)  # in place on silu's fresh output: one temporary fewer


class GeluAndMul(nn.Module):
    """`gelu(gate) * up` (GeGLU, Gemma), exact or with the tanh approximation."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate).mul_(up)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class SwigluOAIAndMul(nn.Module):
    """gpt-oss's clamped SwiGLU (vLLM's `swigluoai`) on `[gate | up]`: the gate is clamped
    above at `limit` and the up projection to `[-limit, limit]`, then
    `(up + 1) * gate * sigmoid(alpha * gate)`. The clamps bound what one expert can add to
    the residual stream; the `+ 1` lets an expert pass its gate through where up is 0."""

    def __init__(self, alpha: float = 1.702, limit: float = 7.0) -> None:
        super().__init__()
        self.alpha, self.limit = float(alpha), float(limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}, limit={self.limit}"


# transformers' names for the GELU variants (ACT2FN): which approximation each one means.
_GELU_APPROXIMATIONS = {"gelu": "none", "gelu_pytorch_tanh": "tanh", "gelu_new": "tanh"}


def get_act_and_mul(hidden_act: str) -> nn.Module:
    """The gated activation named by a HF config's `hidden_act` (or Gemma's `hidden_activation`)."""
    if hidden_act in ("silu", "swish"):
        return SiluAndMul()
    if hidden_act in _GELU_APPROXIMATIONS:
        return GeluAndMul(_GELU_APPROXIMATIONS[hidden_act])
    supported = ", ".join(["silu", "swish", *_GELU_APPROXIMATIONS])
    raise NotImplementedError(
        f"hidden_act {hidden_act!r} is not supported (supported: {supported})"
    )


# HF `hidden_act` names of plain (ungated) activations; gelu is the exact (erf) form, as in HF.
_PLAIN_ACTIVATIONS = {
    "gelu": lambda: nn.GELU(),
    "gelu_new": lambda: nn.GELU(approximate="tanh"),
    "gelu_pytorch_tanh": lambda: nn.GELU(approximate="tanh"),
    "relu": lambda: nn.ReLU(),
    "silu": lambda: nn.SiLU(),
}


def get_act_fn(hidden_act: str) -> nn.Module:
    """The plain activation named by a HF config's `hidden_act`."""
    if hidden_act not in _PLAIN_ACTIVATIONS:
        raise NotImplementedError(
            f"hidden_act {hidden_act!r} is not supported "
            f"(supported: {', '.join(_PLAIN_ACTIVATIONS)})"
        )
    return _PLAIN_ACTIVATIONS[hidden_act]()
