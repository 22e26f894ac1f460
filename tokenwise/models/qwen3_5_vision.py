"""Qwen3.5's vision tower: Qwen2.5-VL's (`qwen2_5_vl_vision.py`) without windows, with learned
position embeddings.

The processor is the same (`Qwen2VLImageProcessor`: flattened patches of two frames, laid out
so each `spatial_merge_size`^2 block of patches is consecutive; `grid_thw` per image), and so
are the attention (bidirectional within each frame, fused qkv with bias) and its 2-D rotary
embedding (a patch's row turns half of each head's frequencies, its column the other half).
What differs, and is built here:

- the patch embedding (HF's Conv3d over exactly one patch, a linear layer here) has a bias;
- a learned table of `num_position_embeddings` (a square of side `sqrt(n)`) is resampled to
  each image's patch grid (bilinear, corners aligned) and added to the patch embeddings;
- every block attends over the whole frame (no windows, so no token permutation);
- blocks use LayerNorm and a plain two-layer MLP (`linear_fc1`, `hidden_act`, `linear_fc2`);
- the merger normalises each patch (LayerNorm) before joining `merge`^2 of them into one row
  of the decoder (`linear_fc1`, GELU, `linear_fc2`).

Qwen3.5 has no deepstack features (Qwen3-VL's per-layer injections into the decoder): the
merger's rows are the only thing the decoder receives.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenwise.models.clip_vision import activation
from tokenwise.models.qwen2_5_vl_vision import (
    Grid,
    PatchEmbed,
    VisionBlock,
    axial_cos_sin,
    axial_inv_freq,
    patch_rows_cols,
)


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, hidden, bias=True)
        self.linear_fc2 = nn.Linear(hidden, dim, bias=True)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


def layer_norm(dim: int) -> nn.Module:
    return nn.LayerNorm(dim, eps=1e-6)


class PatchMerger(nn.Module):
    """LayerNorm per patch, then `merge`^2 consecutive patches -> one decoder row (MLP)."""

    def __init__(self, out_dim: int, dim: int, merge: int) -> None:
        super().__init__()
        self.hidden = dim * merge * merge
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.hidden, self.hidden)
        self.linear_fc2 = nn.Linear(self.hidden, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x).view(-1, self.hidden)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3_5VisionTower(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.merge = int(config.spatial_merge_size)
        self.patch_size = int(config.patch_size)
        dim = int(config.hidden_size)
        in_features = int(config.in_channels) * int(config.temporal_patch_size)
        in_features *= self.patch_size**2
        num_positions = int(config.num_position_embeddings)
        self.side = math.isqrt(num_positions)
        if self.side * self.side != num_positions:
            raise ValueError(
                f"vision num_position_embeddings={num_positions} is not a square number: "
                "Qwen3.5's learned positions form a square grid"
            )
        self.patch_embed = PatchEmbed(in_features, dim, bias=True)
        self.pos_embed = nn.Embedding(num_positions, dim)
        self.blocks = nn.ModuleList(
            VisionBlock(config, layer_norm, VisionMLP) for _ in range(int(config.depth))
        )
        self.merger = PatchMerger(int(config.out_hidden_size), dim, self.merge)
        self.register_buffer("inv_freq", axial_inv_freq(config), persistent=False)

    def position_embeddings(self, grids: list[Grid]) -> torch.Tensor:
        """`[patches, hidden]`: the learned square table resampled to each image's `h x w`
        patches (bilinear, corners aligned, as HF), in the processor's merge-block order."""
        weight = self.pos_embed.weight
        table = weight.view(self.side, self.side, -1).permute(2, 0, 1).unsqueeze(0).float()
        out = []
        m = self.merge
        for t, h, w in grids:
            grid = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)[0]
            grid = grid.permute(1, 2, 0).reshape(h // m, m, w // m, m, -1)
            rows = grid.permute(0, 2, 1, 3, 4).reshape(h * w, -1)
            out.append(rows.repeat(t, 1))
        return torch.cat(out).to(weight.dtype)

    def forward(self, pixel_values: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        """`[patches, C * T * P * P]` of all `grids` -> `[merged tokens, out_hidden]`."""
        x = self.patch_embed(pixel_values)
        x = x + self.position_embeddings(grids).to(x.dtype)
        pos = torch.from_numpy(patch_rows_cols(grids, self.merge)).to(x.device)
        cos, sin = axial_cos_sin(pos, self.inv_freq)
        frames = [h * w for t, h, w in grids for _ in range(t)]
        for block in self.blocks:
            x = block(x, cos, sin, frames)
        return self.merger(x)
