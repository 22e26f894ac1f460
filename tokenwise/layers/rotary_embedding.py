"""Rotary position embeddings looked up by position, for a flat stream of tokens.

Because the engine concatenates many sequences into one step, "position" is not the index in
the batch: every token brings its own position. The cos/sin values are therefore precomputed
for every position up to the model length (in float32, as Hugging Face computes them) and
gathered with `positions`, which costs one small index per layer instead of trigonometry.

The rotation is the neox / HF "rotate_half" convention by default: a head vector is split into
halves (x1, x2) and rotated as (x1 cos - x2 sin, x2 cos + x1 sin). DeepSeek's MLA rotates
interleaved pairs (x0, x1), (x2, x3), ... instead (`is_neox_style=False`, GPT-J style); the
output keeps the pairs interleaved.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tokenwise.layers.rope_yarn import yarn_attention_factor, yarn_inv_freq
from tokenwise.native import fused as cpu_fused

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional", "freq_factors")


def get_rope_config(
    hf_config: Any, layer_type: str | None = None
) -> tuple[float, dict[str, Any] | None]:
    """`(rope_theta, rope_scaling)` from a transformers 4.x or 5.x config.

    4.x keeps `rope_theta` and `rope_scaling` (keyed `type` in older files, `rope_type` later)
    as attributes; 5.x folds both into one `rope_parameters` dict. The scaling dict returned
    always has `rope_type` and is None for plain (unscaled) RoPE.

    Models whose layer types use different RoPE (Gemma 3: local and global bases) pass
    `layer_type`: 5.x keys `rope_parameters` by layer type; 4.x gives sliding layers their own
    `rope_local_base_freq` and no scaling.
    """
    params = getattr(hf_config, "rope_parameters", None)
    if layer_type == "sliding_attention" and getattr(hf_config, "rope_local_base_freq", None):
        if not (isinstance(params, dict) and layer_type in params):
            return float(hf_config.rope_local_base_freq), None
    if isinstance(params, dict) and params:
        if all(isinstance(v, dict) for v in params.values()):
            if layer_type not in params:
                raise NotImplementedError(
                    f"rope parameters per layer type {sorted(params)} need a layer type "
                    f"(got {layer_type!r})"
                )
            params = params[layer_type]
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
        scaling: dict[str, Any] | None = dict(params)
    else:
        theta = getattr(hf_config, "rope_theta", None)
        legacy = getattr(hf_config, "rope_scaling", None)
        scaling = dict(legacy) if legacy else None
    theta = 10000.0 if theta is None else float(theta)
    factors = getattr(hf_config, "rope_freq_factors", None)
    if factors is not None:  # a GGUF file's per-frequency factors (tokenwise.gguf.hf_config)
        return theta, {"rope_type": "freq_factors", "factors": tuple(factors)}
    if scaling is not None:
        scaling.pop("rope_theta", None)
        rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
        scaling.pop("type", None)
        scaling = None if rope_type == "default" else {"rope_type": rope_type, **scaling}
    return theta, scaling


def llama3_inv_freq(
    inv_freq: torch.Tensor,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_position_embeddings: int,
) -> torch.Tensor:
    """Llama 3.1 context extension: slow down only the frequencies that were too slow to wrap.

    A frequency whose wavelength fits many times into the original context (short wavelength)
    already generalises and is kept. One whose wavelength is longer than the original context was
    never seen through a full period, so it is divided by `factor`. Wavelengths in between are
    interpolated linearly in `original_len / wavelength` so that there is no discontinuity.
    """
    old_len = float(original_max_position_embeddings)
    wavelen = 2 * math.pi / inv_freq
    # 0 at the long-wavelength edge (fully scaled), 1 at the short one (kept as is).
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smooth = smooth.clamp(0.0, 1.0)
    return (1.0 - smooth) * inv_freq / factor + smooth * inv_freq


def proportional_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Gemma 4's global layers: only the first `partial_rotary_factor` of the frequency pairs
    rotate, with the exponents of the *whole* head (`2i / head_dim`, not `2i / rotary_dim`);
    the other pairs get frequency 0 (cos 1, sin 0: passed through), so the rotation still
    spans the whole head in the usual rotate-half layout. `factor` divides every frequency."""
    partial = float(scaling.get("partial_rotary_factor", 1.0))
    if not 0.0 <= partial <= 1.0:
        raise ValueError(f"proportional RoPE needs partial_rotary_factor in [0, 1], got {partial}")
    rotated = int(partial * inv_freq.numel())
    out = torch.zeros_like(inv_freq)
    out[:rotated] = inv_freq[:rotated]
    return out / float(scaling.get("factor", 1.0))


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float = 10000.0,
        rope_scaling: dict[str, Any] | None = None,
        is_neox_style: bool = True,
    ) -> None:
        super().__init__()
        self.is_neox_style = is_neox_style
        if head_dim % 2:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}")
        self.head_dim = head_dim
        self.max_position = max_position
        self.base = base
        self.rope_type = (rope_scaling or {}).get("rope_type", "default")
        inv_freq = self._inv_freq(rope_scaling or {})
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        if self.rope_type == "yarn":
            cache = cache * yarn_attention_factor(rope_scaling or {})
        # Not persistent: derived from the config, so it must not appear in state dicts.
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def _inv_freq(self, scaling: dict[str, Any]) -> torch.Tensor:
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim
        inv_freq = 1.0 / (self.base**exponent)
        if self.rope_type == "proportional":
            return proportional_inv_freq(inv_freq, scaling)
        if self.rope_type == "freq_factors":  # llama.cpp's rope_freqs: one divisor per pair
            factors = torch.tensor(scaling["factors"], dtype=torch.float32)
            if factors.shape != inv_freq.shape:
                raise ValueError(
                    f"{factors.numel()} rope frequency factors for a rotary head of "
                    f"{self.head_dim} (needs {inv_freq.numel()})"
                )
            return inv_freq / factors
        if scaling.get("partial_rotary_factor", 1.0) != 1.0:
            raise NotImplementedError("partial rotary embeddings are not supported")
        if self.rope_type == "default":
            return inv_freq
        if self.rope_type == "linear":
            return inv_freq / float(scaling["factor"])
        if self.rope_type == "yarn":
            return yarn_inv_freq(self.head_dim, self.base, scaling)
        if self.rope_type == "llama3":
            return llama3_inv_freq(
                inv_freq,
                factor=float(scaling["factor"]),
                low_freq_factor=float(scaling["low_freq_factor"]),
                high_freq_factor=float(scaling["high_freq_factor"]),
                original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
            )
        raise NotImplementedError(
            f"rope type {self.rope_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if x.dim() == 2:  # [T, heads * head_dim]; no -1, so a symbolic T needs no guard
            x = x.unflatten(-1, (shape[-1] // self.head_dim, self.head_dim))
        if not self.is_neox_style:
            x1, x2 = x[..., 0::2], x[..., 1::2]
            pairs = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
            return pairs.flatten(-2).view(shape)
        x1, x2 = x.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return out.view(shape)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q `[T, heads*head_dim]` and k `[T, kv_heads*head_dim]` (or `[T, h, d]`)."""
        if self.is_neox_style:  # decode-sized CPU tensors: the same values in one C call
            fused = cpu_fused.rope_neox(positions, query, key, self.cos_sin_cache, self.head_dim)
            if fused is not None:
                return fused
        cos, sin = self.cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
        # Like HF, the table is fp32 but the rotation runs in the activations' dtype.
        cos = cos.unsqueeze(1).to(query.dtype)
        sin = sin.unsqueeze(1).to(query.dtype)
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, max_position={self.max_position}, base={self.base}, "
            f"rope_type={self.rope_type!r}, neox_style={self.is_neox_style}"
        )
