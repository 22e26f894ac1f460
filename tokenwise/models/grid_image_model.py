"""What the M-RoPE vision-language models (Qwen2.5-VL, Qwen3.5) share around their towers.

Both take images of any size (`grid_thw`: frames, rows and columns of patches), run all of a
step's missing images through the tower at once and split its rows per image; both take
3-D positions for the step (`mrope_positions`, `[3, T]`) in place of the 1-D ones, and write
image rows over the placeholders' embeddings (`image_merge.py`). A model mixes this class in
before its text model and sets `visual` (the tower, or `StageAbsent` on a later pipeline
stage) and `spatial_merge_size`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenwise.layers.pipeline import IntermediateTensors
from tokenwise.models.image_merge import decode_with_images
from tokenwise.models.qwen2_5_vl_vision import Grid


def check_grids(grids: list[Any], merge: int) -> list[Grid]:
    """The grids, each refused by name unless it is `(t, h, w)` positive with `h` and `w`
    multiples of the merge size (what the processor always gives)."""
    out = []
    for i, grid in enumerate(grids):
        ok = grid is not None and len(grid) == 3 and all(int(n) > 0 for n in grid)
        if not ok or grid[1] % merge or grid[2] % merge:
            raise ValueError(
                f"image {i}: grid_thw {grid} must be three positive sizes (frames, rows, "
                f"columns of patches) with rows and columns multiples of {merge}"
            )
        out.append((int(grid[0]), int(grid[1]), int(grid[2])))
    return out


class GridImageModel(nn.Module):
    is_multimodal = True
    uses_mrope = True
    visual: nn.Module
    spatial_merge_size: int
    model: Any

    def use_rotary(self, rotary: nn.Module) -> None:
        """Put the M-RoPE layer in place of the text model's rotary, in every attention layer
        this stage holds (a pipeline stage's other layers are `StageAbsent`)."""
        self.model.rotary_emb = rotary
        for layer in self.model.layers:
            if hasattr(layer, "self_attn"):
                layer.self_attn.rotary_emb = rotary

    def tokens_per_image(self, grid: Grid) -> int:
        t, h, w = grid
        return t * h * w // (self.spatial_merge_size**2)

    def embed_image_list(
        self, pixel_values: list[torch.Tensor], grids: list[Grid | None]
    ) -> list[torch.Tensor]:
        """Each image's `[tokens, hidden]` rows; the images run through the tower together."""
        known = check_grids(grids, self.spatial_merge_size)
        for i, (pixels, (t, h, w)) in enumerate(zip(pixel_values, known, strict=True)):
            if pixels.dim() != 2 or pixels.shape[0] != t * h * w:
                raise ValueError(
                    f"image {i}: pixel_values of shape {tuple(pixels.shape)} do not hold the "
                    f"{t * h * w} flattened patches of grid_thw {(t, h, w)}"
                )
        merged = self.visual(torch.cat(pixel_values), known)
        return list(merged.split([self.tokens_per_image(g) for g in known]))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        image_embeds: torch.Tensor | None = None,
        image_token_rows: torch.Tensor | None = None,
        mrope_positions: torch.Tensor | None = None,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """`mrope_positions` (`[3, T]`) replace `positions`; `image_embeds[i]` replaces the
        embedding of flat token `image_token_rows[i]`; a later pipeline stage starts from
        `intermediate_tensors`."""
        if mrope_positions is not None:
            positions = mrope_positions
        if intermediate_tensors is not None:
            return self.model(input_ids, positions, intermediate_tensors=intermediate_tensors)
        return decode_with_images(self.model, input_ids, positions, image_embeds, image_token_rows)
