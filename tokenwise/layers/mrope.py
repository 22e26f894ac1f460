"""Multimodal rotary embeddings (M-RoPE, Qwen2-VL / Qwen2.5-VL): three position axes per token.

A token of such a model has a temporal, a height and a width position (`positions` of shape
`[3, num_tokens]`). Text tokens have the same value on all three axes, so for them M-RoPE is
plain RoPE; an image's tokens share one temporal position and take their row and column in
the image's grid on the other two. The rotary frequencies are split into three bands
(`mrope_section`, e.g. [16, 24, 24] of head_dim / 2 = 64 frequencies): band i rotates by the
position on axis i. With the neox ("rotate half") layout, frequency j drives head dimensions
j and j + head_dim / 2, so the cos/sin rows of the three axes are gathered from the same
table as 1-D RoPE and spliced band by band.

Qwen3-VL / Qwen3.5 interleave the axes instead of banding them (`interleaved=True`):
frequency j follows the height when `j % 3 == 1` and `j < 3 * section[1]`, the width when
`j % 3 == 2` and `j < 3 * section[2]`, else time; the sections need not cover the rotary.

One-dimensional `positions` (a step of a text-only model) take the 1-D path unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

from tokenwise.layers.rotary_embedding import RotaryEmbedding


def get_mrope_section(hf_config: Any) -> list[int] | None:
    """The `mrope_section` of a transformers 4.x (`rope_scaling`) or 5.x (`rope_parameters`)
    text config; None when the model has 1-D positions."""
    for name in ("rope_parameters", "rope_scaling"):
        params = getattr(hf_config, name, None)
        if isinstance(params, dict) and params.get("mrope_section") is not None:
            return [int(s) for s in params["mrope_section"]]
    return None


def axis_of_frequency(section: list[int], num_freqs: int, interleaved: bool) -> torch.Tensor:
    """The axis (0: temporal, 1: height, 2: width) each of `num_freqs` frequencies follows."""
    if not interleaved:
        return torch.repeat_interleave(torch.arange(3), torch.tensor(section))
    j = torch.arange(num_freqs)
    axis = torch.zeros_like(j)
    axis[(j % 3 == 1) & (j < 3 * section[1])] = 1
    axis[(j % 3 == 2) & (j < 3 * section[2])] = 2
    return axis


class MRotaryEmbedding(RotaryEmbedding):
    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        mrope_section: list[int],
        rope_scaling: dict[str, Any] | None = None,
        interleaved: bool = False,
    ) -> None:
        super().__init__(head_dim, max_position, base, rope_scaling)
        if len(mrope_section) != 3 or min(mrope_section) < 0:
            raise ValueError(f"mrope_section must be three sizes >= 0, got {mrope_section}")
        if not interleaved and sum(mrope_section) != head_dim // 2:
            raise ValueError(
                f"mrope_section must be three band sizes summing to head_dim / 2 = "
                f"{head_dim // 2}, got {mrope_section}"
            )
        self.mrope_section = list(mrope_section)
        self.interleaved = interleaved
        axis = axis_of_frequency(self.mrope_section, head_dim // 2, interleaved)
        self.register_buffer("axis_of_dim", torch.cat((axis, axis)), persistent=False)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().forward(positions, query, key)
        num_tokens = positions.shape[1]
        # [3, T, head_dim]: each axis' cos|sin row; then each dimension takes its band's axis.
        rows = self.cos_sin_cache.index_select(0, positions.reshape(-1))
        rows = rows.view(3, num_tokens, self.head_dim)
        index = self.axis_of_dim.view(1, 1, -1).expand(1, num_tokens, -1)
        cos_sin = rows.gather(0, index).squeeze(0)
        cos, sin = cos_sin.chunk(2, dim=-1)
        cos = cos.unsqueeze(1).to(query.dtype)
        sin = sin.unsqueeze(1).to(query.dtype)
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)

    def extra_repr(self) -> str:
        extra = ", interleaved" if self.interleaved else ""
        return f"{super().extra_repr()}, mrope_section={self.mrope_section}{extra}"
