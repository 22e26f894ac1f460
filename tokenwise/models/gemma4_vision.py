"""Gemma 4's vision tower and its embedder: an image's patches to rows of the decoder.

The image processor (`Gemma4ImageProcessorPil`) keeps an image's aspect ratio: it resizes it
to a grid of `rows x cols` patches (both multiples of `pooling_kernel_size`, at most its
patch budget) and flattens each patch, so every image has its own number of soft tokens,
`rows * cols / pooling_kernel_size^2`. The tower:

1. embeds each flattened patch (pixels mapped from [0, 1] to [-1, 1], one matrix) plus a
   learned embedding of its column and one of its row;
2. runs Gemma-style blocks (four RMSNorms, q/k/v norms, attention scale 1, a gated MLP)
   with bidirectional attention inside each image and a 2-D rotary embedding: a patch's
   column rotates the first half of each head, its row the second half;
3. average-pools each `pooling_kernel_size^2` square of patches into one row, scales it by
   `sqrt(hidden_size)` (in float32: the scale can leave float16's range) and, when the
   config says `standardize`, subtracts `std_bias` and multiplies by `std_scale`.

The embedder (`embed_vision`) then RMS-normalises each row without a scale and projects it
to the decoder's hidden size. Where the config says `use_clipped_linears`, each linear layer
clamps its input and output to bounds stored in the checkpoint.

Images never attend to each other, so a batch of images runs as one sequence of segments
(`segment_attention`), without HF's padding to the patch budget.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenwise.layers.layernorm import Gemma4RMSNorm
from tokenwise.models.clip_vision import activation
from tokenwise.models.qwen2_5_vl_vision import rotate_half, segment_attention

Grid = tuple[int, int, int]


class ClippableLinear(nn.Module):
    """A bias-free linear layer whose input and output may be clamped (checkpoint bounds)."""

    def __init__(self, in_features: int, out_features: int, clipped: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=False)
        self.clipped = clipped
        if clipped:
            for name in ("input_min", "input_max", "output_min", "output_max"):
                sign = -1.0 if name.endswith("min") else 1.0
                self.register_buffer(name, torch.tensor(sign * float("inf")))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.clipped:
            return self.linear(x)
        x = torch.clamp(x, self.input_min, self.input_max)
        return torch.clamp(self.linear(x), self.output_min, self.output_max)


def axial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `[T, heads, d]`: the first half of each head by the column's angles, the second
    by the row's (`cos`/`sin`: `[T, 2, d / 2]`, per axis)."""
    halves = x.chunk(2, dim=-1)
    out = [
        h * c[:, None] + rotate_half(h) * s[:, None]
        for h, c, s in zip(halves, cos.unbind(1), sin.unbind(1), strict=True)
    ]
    return torch.cat(out, dim=-1)


class Gemma4VisionAttention(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        hidden, clipped = int(cfg.hidden_size), bool(cfg.use_clipped_linears)
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(cfg.head_dim)
        eps = float(cfg.rms_norm_eps)
        self.q_proj = ClippableLinear(hidden, self.num_heads * self.head_dim, clipped)
        self.k_proj = ClippableLinear(hidden, self.num_kv_heads * self.head_dim, clipped)
        self.v_proj = ClippableLinear(hidden, self.num_kv_heads * self.head_dim, clipped)
        self.o_proj = ClippableLinear(self.num_heads * self.head_dim, hidden, clipped)
        self.q_norm = Gemma4RMSNorm(self.head_dim, eps)
        self.k_norm = Gemma4RMSNorm(self.head_dim, eps)
        self.v_norm = Gemma4RMSNorm(self.head_dim, eps, with_scale=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]
    ) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        q = axial_rope(self.q_norm(self.q_proj(x).view(t, self.num_heads, d)), cos, sin)
        k = axial_rope(self.k_norm(self.k_proj(x).view(t, self.num_kv_heads, d)), cos, sin)
        v = self.v_norm(self.v_proj(x).view(t, self.num_kv_heads, d))
        if self.num_kv_heads != self.num_heads:  # query head j reads KV head j // group
            group = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = segment_attention(q, k, v, lengths, scale=1.0)  # the norms set the magnitude
        return self.o_proj(out.reshape(t, -1))


class Gemma4VisionMLP(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        hidden, inter, clipped = (
            int(cfg.hidden_size),
            int(cfg.intermediate_size),
            bool(cfg.use_clipped_linears),
        )
        self.gate_proj = ClippableLinear(hidden, inter, clipped)
        self.up_proj = ClippableLinear(hidden, inter, clipped)
        self.down_proj = ClippableLinear(inter, hidden, clipped)
        self.act = activation(cfg.hidden_activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Gemma4VisionLayer(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        hidden, eps = int(cfg.hidden_size), float(cfg.rms_norm_eps)
        self.self_attn = Gemma4VisionAttention(cfg)
        self.mlp = Gemma4VisionMLP(cfg)
        self.input_layernorm = Gemma4RMSNorm(hidden, eps)
        self.post_attention_layernorm = Gemma4RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = Gemma4RMSNorm(hidden, eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), cos, sin, lengths)
        x = x + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(mlp)


class Gemma4PatchEmbedder(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        hidden, patch = int(cfg.hidden_size), int(cfg.patch_size)
        self.input_proj = nn.Linear(3 * patch * patch, hidden, bias=False)
        size = int(cfg.position_embedding_size)
        self.position_embedding_table = nn.Parameter(torch.ones(2, size, hidden))

    def forward(
        self, patches: torch.Tensor, cols: torch.Tensor, rows: torch.Tensor
    ) -> torch.Tensor:
        x = self.input_proj((2 * (patches - 0.5)).to(self.input_proj.weight.dtype))
        table = self.position_embedding_table
        return x + table[0][cols] + table[1][rows]


class Gemma4Encoder(nn.Module):
    """HF's `encoder.*`: the blocks (the rotary table has no weights)."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Gemma4VisionLayer(cfg) for _ in range(cfg.num_hidden_layers))


class Gemma4VisionTower(nn.Module):
    """`[patches, 3 * patch^2]` of several images (their `(1, rows, cols)` grids) -> one
    `[rows * cols / k^2, hidden]` tensor per image (`k`: `pooling_kernel_size`)."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        rope = getattr(cfg, "rope_parameters", None) or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(
                f"Gemma 4's vision tower supports rope_type 'axial', got {rope['rope_type']!r}"
            )
        self.kernel = int(cfg.pooling_kernel_size)
        self.hidden_size = int(cfg.hidden_size)
        self.max_position = int(cfg.position_embedding_size)
        head_dim = int(cfg.head_dim)
        theta = float(rope.get("rope_theta", 100.0))
        spatial = head_dim // 2
        inv_freq = 1.0 / theta ** (torch.arange(0, spatial, 2, dtype=torch.float32) / spatial)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.patch_embedder = Gemma4PatchEmbedder(cfg)
        self.encoder = Gemma4Encoder(cfg)
        self.standardize = bool(getattr(cfg, "standardize", False))
        if self.standardize:
            self.register_buffer("std_bias", torch.zeros(self.hidden_size))
            self.register_buffer("std_scale", torch.ones(self.hidden_size))

    def positions(self, grids: list[Grid], device: torch.device) -> torch.Tensor:
        """`[patches, 2]`: each patch's (column, row), image after image, row-major."""
        out = []
        for _, rows, cols in grids:
            if rows % self.kernel or cols % self.kernel:
                raise ValueError(
                    f"an image of {rows}x{cols} patches cannot be pooled in "
                    f"{self.kernel}x{self.kernel} squares (pooling_kernel_size)"
                )
            if max(rows, cols) > self.max_position:
                raise ValueError(
                    f"an image of {rows}x{cols} patches exceeds the tower's "
                    f"position_embedding_size={self.max_position}"
                )
            r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
            out.append(torch.stack([c.reshape(-1), r.reshape(-1)], dim=-1))
        return torch.cat(out).to(device)

    def forward(self, patches: torch.Tensor, grids: list[Grid]) -> list[torch.Tensor]:
        pos = self.positions(grids, patches.device)
        lengths = [rows * cols for _, rows, cols in grids]
        if patches.shape[0] != sum(lengths):
            raise ValueError(
                f"{patches.shape[0]} patches given for images of {sum(lengths)} patches"
            )
        x = self.patch_embedder(patches, pos[:, 0], pos[:, 1])
        angles = pos[:, :, None].float() * self.inv_freq  # [T, 2 axes, d / 4]
        angles = torch.cat([angles, angles], dim=-1)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        for layer in self.encoder.layers:
            x = layer(x, cos, sin, lengths)
        return [self._pool(h, grid) for h, grid in zip(x.split(lengths), grids, strict=True)]

    def _pool(self, h: torch.Tensor, grid: Grid) -> torch.Tensor:
        _, rows, cols = grid
        square = h.float().t().reshape(1, -1, rows, cols)
        pooled = F.avg_pool2d(square, self.kernel).flatten(2)[0].t()
        pooled = pooled * self.hidden_size**0.5
        if self.standardize:
            pooled = (pooled - self.std_bias.float()) * self.std_scale.float()
        return pooled.to(h.dtype)


class Gemma4MultimodalEmbedder(nn.Module):
    """Tower rows -> the decoder's hidden size: a scale-free RMSNorm, then one matrix."""

    def __init__(self, vision_hidden: int, text_hidden: int, eps: float) -> None:
        super().__init__()
        self.embedding_pre_projection_norm = Gemma4RMSNorm(vision_hidden, eps, with_scale=False)
        self.embedding_projection = nn.Linear(vision_hidden, text_hidden, bias=False)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return self.embedding_projection(self.embedding_pre_projection_norm(rows))
