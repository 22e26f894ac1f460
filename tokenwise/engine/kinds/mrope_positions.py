"""3-D (M-RoPE) positions: per prompt once, per step from those.

A Qwen2.5-VL token has a temporal, a height and a width position. In a prompt, text tokens
advance all three together; an image's tokens (a `t x h x w` grid of merged patches) sit at
`start + (frame, row, column)` where `start` is the position the next text token would have
had; the text after an image resumes at one past the largest position the image used
(`start + max(h, w)`). The prompt so ends at a position
`delta` away from its length (negative after images wider or taller than one token), and
every later token at flat index `p` (generated, or recomputed after a preemption) has
position `p + delta` on all three axes: HF's `get_rope_index` and its `rope_deltas`.

`prompt_mrope_positions` runs once when the prompt is processed; `step_mrope_positions` fills
a step's `[tokens, 3]` buffer from the scheduled chunks, which may start or stop anywhere,
inside an image too.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tokenwise.engine.kinds.image_inputs import ImageInput


def prompt_mrope_positions(
    num_tokens: int, images: list[ImageInput], merge_size: int
) -> tuple[np.ndarray, int]:
    """`([3, num_tokens] int64 positions, delta)` of a prompt with `images` in order."""
    out = np.empty((3, num_tokens), dtype=np.int64)
    cursor = 0  # next prompt index to place
    position = 0  # the position that index would take as text
    for image in images:
        assert image.grid_thw is not None
        text = image.offset - cursor
        out[:, cursor : image.offset] = position + np.arange(text)
        position += text
        t, h, w = image.grid_thw
        h, w = h // merge_size, w // merge_size
        frames, rows, cols = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        grid = np.stack([frames.reshape(-1), rows.reshape(-1), cols.reshape(-1)])
        if grid.shape[1] != image.length:
            raise ValueError(
                f"an image of grid {image.grid_thw} needs {grid.shape[1]} tokens, the prompt "
                f"has {image.length}"
            )
        out[:, image.offset : image.end] = grid + position
        position += max(h, w)
        cursor = image.end
    out[:, cursor:] = position + np.arange(num_tokens - cursor)
    return out, int(position - cursor)  # the last position + 1 - num_tokens


def step_mrope_positions(
    out: np.ndarray, positions: np.ndarray, scheduled: list[Any], states: list[Any]
) -> np.ndarray:
    """Fill `out[:T]` (`[T, 3]`) for a step whose flat 1-D positions are `positions[:T]` and
    whose chunks are `scheduled` (in flat order; `states`: the runner's states of them, whose
    `kind_inputs` hold the positions): a prompt token takes its request's precomputed row, any
    other token `p + delta` on all three axes."""
    start = 0
    for item, state in zip(scheduled, states, strict=True):
        inputs = state.kind_inputs
        new = item.num_new_tokens
        chunk = out[start : start + new]
        chunk[:] = (positions[start : start + new] + inputs["mrope_position_delta"])[:, None]
        table = inputs["mrope_positions"]
        if table is not None:
            computed = item.num_computed_tokens
            hi = min(computed + new, table.shape[1])
            if hi > computed:
                chunk[: hi - computed] = table[:, computed:hi].T
        start += new
    return out[:start]
