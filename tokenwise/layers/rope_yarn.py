"""YaRN RoPE scaling (DeepSeek-V2/V3's long-context extension), as transformers computes it.

YaRN stretches the context by `factor` without retraining the fast rotations: a rotary pair
whose wavelength is short compared with the original context already generalises and keeps its
frequency (extrapolation), a slow one is divided by `factor` (interpolation), and the pairs in
between are blended along a linear ramp over pair indices whose ends are where a pair makes
`beta_fast` and `beta_slow` turns over the original context. Because interpolation flattens
attention, cos and sin are multiplied by an `attention_factor` (from `mscale` /
`mscale_all_dim` when both are given, else `0.1 ln(factor) + 1`).
"""

from __future__ import annotations

import math
from typing import Any

import torch


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """`0.1 * mscale * ln(scale) + 1`, or 1 for no stretch (`scale <= 1`)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _factor(scaling: dict[str, Any]) -> float:
    factor = scaling.get("factor")
    if factor is None:
        raise ValueError("yarn rope scaling needs 'factor' in rope_scaling / rope_parameters")
    return float(factor)


def yarn_attention_factor(scaling: dict[str, Any]) -> float:
    """The factor cos and sin are multiplied by."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = _factor(scaling)
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_get_mscale(factor, float(mscale)) / yarn_get_mscale(
            factor, float(mscale_all_dim)
        )
    return yarn_get_mscale(factor)


def _correction_dim(num_rotations: float, dim: int, base: float, max_position: int) -> float:
    """The pair index (as a real number) whose frequency makes `num_rotations` turns over
    `max_position` positions."""
    return (dim * math.log(max_position / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def yarn_inv_freq(dim: int, base: float, scaling: dict[str, Any]) -> torch.Tensor:
    """Per-pair inverse frequencies of a `dim`-wide rotary head under YaRN."""
    factor = _factor(scaling)
    if scaling.get("original_max_position_embeddings") is None:
        raise ValueError(
            "yarn rope scaling needs 'original_max_position_embeddings' in rope_scaling / "
            "rope_parameters"
        )
    original = int(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)
    low = _correction_dim(beta_fast, dim, base, original)
    high = _correction_dim(beta_slow, dim, base, original)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the pair keeps its frequency, 0: it is divided by `factor`
    return interpolation * (1 - keep) + extrapolation * keep
