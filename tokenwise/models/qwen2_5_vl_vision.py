"""Qwen2.5-VL's vision tower: patches of any image size to rows of the decoder.

The image processor cuts each image into `patch_size` squares (two frames of a still image,
`temporal_patch_size`), lays them out so that every `spatial_merge_size`^2 consecutive patches
form one square block, and flattens each patch; `grid_thw` says how many frames, rows and
columns of patches an image has. The tower:

1. embeds each flattened patch (HF's Conv3d over one patch is a matmul with its flattened
   kernel: a linear layer here);
2. runs blocks of bidirectional attention with a 2-D rotary embedding (a patch's row rotates
   half of each head's frequencies, its column the other half). Most blocks attend within
   windows of `window_size` pixels (a window is a square of merged blocks); the blocks listed
   in `fullatt_block_indexes` attend over the whole image. Tokens are permuted once so every
   window is contiguous, and back after the merger;
3. merges each block of `spatial_merge_size`^2 patches into one row (RMSNorm, MLP) of the
   decoder's hidden size: one row per image placeholder token.

Images never attend to each other, so several images run as one sequence of segments.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tokenwise.models.clip_vision import activation

Grid = tuple[int, int, int]


class VisionRMSNorm(nn.Module):
    """RMSNorm computed in float32 (as HF's), without the fused residual of the decoder's."""

    def __init__(self, hidden: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def segment_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: list[int],
    scale: float | None = None,
) -> torch.Tensor:
    """Bidirectional attention within consecutive segments of `[T, heads, head_dim]` tensors.
    Segments of one length run as one batch (most windows of an image have the same size).
    `scale`: the logits' factor (None: `head_dim ** -0.5`)."""
    out = torch.empty_like(q)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
    lengths_np = np.asarray(lengths, dtype=np.int64)
    for length in np.unique(lengths_np):
        if length == 0:
            continue
        first = starts[lengths_np == length]
        rows = torch.from_numpy((first[:, None] + np.arange(length)).reshape(-1)).to(q.device)
        shape = (len(first), int(length), *q.shape[1:])
        qs, ks, vs = (x.index_select(0, rows).view(shape).transpose(1, 2) for x in (q, k, v))
        attn = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)
        out[rows] = attn.transpose(1, 2).reshape(-1, *q.shape[1:])
    return out


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        # The rotation in float32, as HF applies it.
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(x.dtype)
        return self.proj(segment_attention(q, k, v, lengths).reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=True)
        self.up_proj = nn.Linear(dim, hidden, bias=True)
        self.down_proj = nn.Linear(hidden, dim, bias=True)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    """Pre-norm attention and MLP; Qwen3.5's tower passes its own norm and MLP classes."""

    def __init__(
        self,
        config: Any,
        norm: Callable[[int], nn.Module] = VisionRMSNorm,
        mlp: Callable[[int, int, str], nn.Module] = VisionMLP,
    ) -> None:
        super().__init__()
        dim = int(config.hidden_size)
        self.norm1 = norm(dim)
        self.norm2 = norm(dim)
        self.attn = VisionAttention(dim, int(config.num_heads))
        self.mlp = mlp(dim, int(config.intermediate_size), str(config.hidden_act))

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    """A flattened patch -> hidden: HF's Conv3d, whose kernel covers exactly one patch."""

    def __init__(self, in_features: int, dim: int, bias: bool = False) -> None:
        super().__init__()
        self.proj = nn.Linear(in_features, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x.to(self.proj.weight.dtype))


class PatchMerger(nn.Module):
    """`spatial_merge_size`^2 consecutive patches -> one decoder row: RMSNorm, MLP."""

    def __init__(self, out_dim: int, dim: int, merge: int) -> None:
        super().__init__()
        self.hidden = dim * merge * merge
        self.ln_q = VisionRMSNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(self.hidden, self.hidden), nn.GELU(), nn.Linear(self.hidden, out_dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.hidden))


def axial_inv_freq(config: Any) -> torch.Tensor:
    """The inverse frequencies of the 2-D rotary: rows and columns each take head_dim / 4
    frequencies of a head_dim / 2 rotary."""
    head_dim = int(config.hidden_size) // int(config.num_heads)
    params = getattr(config, "rope_parameters", None) or {}
    theta = float(params.get("rope_theta", 10000.0))
    quarter = head_dim // 2
    return 1.0 / theta ** (torch.arange(0, quarter, 2, dtype=torch.float32) / quarter)


def axial_cos_sin(rows_cols: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """cos and sin (`[patches, 1, head_dim]`) of patches at `rows_cols` (`[patches, 2]`): the
    row's frequencies, then the column's, repeated for both halves of the head."""
    freqs = (rows_cols[..., None].float() * inv_freq).flatten(1)
    emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
    return emb.cos(), emb.sin()


def window_layout(grids: list[Grid], merge: int, window: int) -> tuple[np.ndarray, list[int]]:
    """The merged-block order that makes every attention window contiguous, and the windows'
    lengths in patches. A frame of `h x w` merged blocks is cut into `window x window`
    squares (smaller at the right and bottom edges), row by row; windows never span frames
    or images."""
    order: list[np.ndarray] = []
    lengths: list[int] = []
    base = 0
    for t, h, w in grids:
        h, w = h // merge, w // merge
        index = np.arange(t * h * w).reshape(t, h, w) + base
        for frame in index:
            for r in range(0, h, window):
                for c in range(0, w, window):
                    cell = frame[r : r + window, c : c + window].reshape(-1)
                    order.append(cell)
                    lengths.append(len(cell) * merge * merge)
        base += t * h * w
    return np.concatenate(order), lengths


def patch_rows_cols(grids: list[Grid], merge: int) -> np.ndarray:
    """`[patches, 2]`: each patch's row and column in its image, in the processor's layout
    (merge blocks row by row, the patches of a block row by row; frames repeat)."""
    out = []
    for t, h, w in grids:
        rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        shape = (h // merge, merge, w // merge, merge)
        rows = rows.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
        cols = cols.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
        out.append(np.tile(np.stack([rows, cols], axis=-1), (t, 1)))
    return np.concatenate(out)


class Qwen2_5_VisionTower(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.merge = int(config.spatial_merge_size)
        self.patch_size = int(config.patch_size)
        self.window = int(config.window_size) // self.merge // self.patch_size
        if self.window < 1:
            raise ValueError(
                f"vision window_size {config.window_size} is smaller than one merged block "
                f"({self.merge} x {self.patch_size} pixels)"
            )
        self.fullatt_block_indexes = {int(i) for i in config.fullatt_block_indexes}
        dim = int(config.hidden_size)
        in_features = int(config.in_channels) * int(config.temporal_patch_size)
        in_features *= self.patch_size**2
        self.patch_embed = PatchEmbed(in_features, dim)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(int(config.depth)))
        self.merger = PatchMerger(int(config.out_hidden_size), dim, self.merge)
        self.register_buffer("inv_freq", axial_inv_freq(config), persistent=False)

    def forward(self, pixel_values: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        """`[patches, C * T * P * P]` of all `grids` -> `[merged tokens, out_hidden]`."""
        unit = self.merge * self.merge
        order, window_lengths = window_layout(grids, self.merge, self.window)
        # Patch rows in window order: each merged block keeps its `unit` patches together.
        patch_order = torch.from_numpy((order[:, None] * unit + np.arange(unit)).reshape(-1))
        patch_order = patch_order.to(pixel_values.device)
        x = self.patch_embed(pixel_values)
        x = x.index_select(0, patch_order)
        pos = torch.from_numpy(patch_rows_cols(grids, self.merge)).to(x.device)
        cos, sin = axial_cos_sin(pos.index_select(0, patch_order), self.inv_freq)
        image_lengths = [h * w for t, h, w in grids for _ in range(t)]
        for i, block in enumerate(self.blocks):
            lengths = image_lengths if i in self.fullatt_block_indexes else window_lengths
            x = block(x, cos, sin, lengths)
        merged = self.merger(x)
        inverse = torch.from_numpy(np.argsort(order)).to(merged.device)
        return merged.index_select(0, inverse)
