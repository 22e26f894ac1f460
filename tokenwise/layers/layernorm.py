"""RMSNorm with the residual add folded in.

Every pre-norm decoder layer does `residual = residual + x; x = norm(residual)`. Doing both in one
call keeps the decoder layer short and gives a compiler one fusion region. The arithmetic follows
Hugging Face exactly (add in the model dtype, normalise in float32, cast back, *then* multiply
by the weight), so in bf16 the rounding happens at the same points as in HF.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenwise.native import fused as cpu_fused


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`norm(x)`, or with a residual `(norm(x + residual), x + residual)`."""
        fused = cpu_fused.rms_norm(x, self.weight, self.eps, residual)
        if fused is not None:  # decode-sized CPU rows: the same values in one C call
            return fused[0] if residual is None else fused  # type: ignore[return-value]
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the checkpoint stores `weight - 1`, so the scale is `1 + weight`.

    Unlike `RMSNorm`, the scale is applied in float32 *before* the cast back, which is where
    transformers rounds for Gemma; matching it keeps bf16 outputs identical.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = cpu_fused.rms_norm(x, self.weight, self.eps, gemma=True)
        if fused is not None:  # decode-sized CPU rows: one C call instead of eight ops
            return fused[0]
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"


class Gemma4RMSNorm(nn.Module):
    """Gemma 4's RMSNorm: a plain `weight` (not Gemma 2/3's `1 + weight`), applied in float32
    before the cast back as transformers does; `with_scale=False` (the value norm, the MoE
    router's input norm) normalises only and has no parameter at all."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, with_scale: bool = True) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = (
            nn.Parameter(torch.ones(hidden_size), requires_grad=False) if with_scale else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.pow(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            x32 = x32 * self.weight.float()
        return x32.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, with_scale={self.weight is not None}"
