"""Videos for the Qwen3-VL-style models (Qwen3.5): frames checked, resized, normalised and cut
into the vision tower's patches, as HF's `Qwen3VLVideoProcessor` defines it.

HF's video processors resize with torchvision, which does not install beside this torch, so
the preprocessing is done here, with PIL and numpy (the image processor's backend):

- a video is `multi_modal_data={"video": frames}` (vLLM's form): a `(T, H, W, 3)` uint8 array
  or a list of PIL images, optionally as `(frames, {"fps": ..., "frames_indices": [...]})`.
  The frames are taken as already sampled (none dropped); `fps` and the frames' indices in
  the source only place the timestamps (HF assumes 24 fps when told nothing);
- every frame gets one size: multiples of `patch_size * merge_size` whose pixels over *all*
  frames (`frames x height x width`) fall within the processor's `[min, max]` pixels,
  keeping the aspect ratio (Qwen3-VL's `smart_resize`, which refuses fewer frames than
  `temporal_patch_size`);
- an odd frame count repeats the last frame; each `temporal_patch_size` frames form one
  temporal group, and each group is patchified as an image is (channels, then the group's
  frames, then the patch's rows and columns, in one flat row per patch, merge blocks
  contiguous), so a group has `grid_thw = (1, rows, columns)`.

The sizes come from the checkpoint's `video_preprocessor_config.json` when it has one, else
from its image processor (the same patch sizes, mean and std).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

DEFAULT_FPS = 24.0  # HF's Qwen3-VL processor's assumption when a video comes without fps


@dataclass(frozen=True)
class VideoSettings:
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    rescale: float = 1 / 255

    @classmethod
    def of_checkpoint(cls, model_dir: str, image_processor: Any) -> VideoSettings:
        """The checkpoint's video processor settings; its image processor's where absent."""
        path = os.path.join(model_dir, "video_preprocessor_config.json")
        config: dict[str, Any] = {}
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                config = json.load(f)

        def get(key: str) -> Any:
            return config[key] if config.get(key) is not None else getattr(image_processor, key)

        size = config.get("size") or image_processor.size
        size = dict(size) if not isinstance(size, dict) else size
        return cls(
            patch_size=int(get("patch_size")),
            temporal_patch_size=int(get("temporal_patch_size")),
            merge_size=int(get("merge_size")),
            min_pixels=int(size.get("shortest_edge") or config.get("min_pixels")),
            max_pixels=int(size.get("longest_edge") or config.get("max_pixels")),
            mean=tuple(float(x) for x in get("image_mean")),  # type: ignore[arg-type]
            std=tuple(float(x) for x in get("image_std")),  # type: ignore[arg-type]
            rescale=float(get("rescale_factor")),
        )


@dataclass(frozen=True)
class ProcessedVideo:
    """A video's temporal groups: `pixel_values` `[groups * rows * cols, patch]`, each group's
    grid `(1, rows, cols)`, and each group's timestamp in seconds."""

    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]  # the whole video's (groups, rows, cols)
    timestamps: list[float]

    def groups(self) -> list[torch.Tensor]:
        t, h, w = self.grid_thw
        return list(self.pixel_values.split([h * w] * t))


def video_frames(data: Any, index: int) -> tuple[np.ndarray, dict[str, Any]]:
    """One `multi_modal_data["video"]` entry as `(T, H, W, 3)` uint8 and its metadata,
    refused by name unless it is such an array or a list of PIL images."""
    from PIL import Image

    name = f"multi_modal_data['video'][{index}]"
    metadata: dict[str, Any] = {}
    if isinstance(data, tuple) and len(data) == 2 and isinstance(data[1], dict):
        data, metadata = data
    if isinstance(data, list) and data and all(isinstance(f, Image.Image) for f in data):
        sizes = {f.size for f in data}
        if len(sizes) != 1:
            raise ValueError(f"{name}: the frames have different sizes {sorted(sizes)}")
        data = np.stack([np.asarray(f.convert("RGB")) for f in data])
    if isinstance(data, torch.Tensor):
        data = data.numpy()
    if not isinstance(data, np.ndarray):
        raise ValueError(
            f"{name} must be a (frames, height, width, 3) uint8 numpy array or a list of PIL "
            f"images, got {type(data).__name__}"
        )
    if data.dtype != np.uint8:
        raise ValueError(f"{name} must have dtype uint8 (0..255 RGB), got {data.dtype}")
    if data.ndim != 4 or data.shape[-1] != 3 or min(data.shape) < 1:
        raise ValueError(
            f"{name} must have shape (frames, height, width, 3), got {tuple(data.shape)}"
        )
    return data, metadata


def smart_resize(settings: VideoSettings, frames: int, height: int, width: int) -> tuple[int, int]:
    """Qwen3-VL's video size: multiples of the merged patch with `frames x h x w` pixels in the
    processor's range, the aspect ratio kept."""
    factor, temporal = settings.patch_size * settings.merge_size, settings.temporal_patch_size
    if frames < temporal:
        raise ValueError(
            f"a video needs at least {temporal} frames (temporal_patch_size), got {frames}"
        )
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"a video's aspect ratio must be under 200, got {width}x{height}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(frames / temporal) * temporal
    if t_bar * h_bar * w_bar > settings.max_pixels:
        beta = math.sqrt(frames * height * width / settings.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < settings.min_pixels:
        beta = math.sqrt(settings.min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def group_timestamps(indices: list[int], fps: float, temporal: int) -> list[float]:
    """Each temporal group's time: the mean of its first and last frame's (HF's Qwen3-VL)."""
    indices = list(indices) + [indices[-1]] * (-len(indices) % temporal)
    seconds = [i / fps for i in indices]
    return [(seconds[i] + seconds[i + temporal - 1]) / 2 for i in range(0, len(seconds), temporal)]


def patchify(video: np.ndarray, settings: VideoSettings) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Normalised frames `[T, H, W, C]` as `[groups * rows * cols, C * temporal * patch^2]`
    rows (an odd count repeats the last frame) and the grid `(groups, rows, cols)`."""
    temporal, patch, merge = settings.temporal_patch_size, settings.patch_size, settings.merge_size
    if pad := -video.shape[0] % temporal:
        video = np.concatenate([video, np.repeat(video[-1:], pad, axis=0)])
    groups, rows, cols = (
        video.shape[0] // temporal,
        video.shape[1] // patch,
        video.shape[2] // patch,
    )
    patches = video.reshape(
        groups, temporal, rows // merge, merge, patch, cols // merge, merge, patch, video.shape[3]
    )
    # -> groups, row blocks, column blocks, rows and columns in a block, channel, frame, pixels
    patches = patches.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7)
    return patches.reshape(groups * rows * cols, -1), (groups, rows, cols)


def process_video(settings: VideoSettings, data: Any, index: int) -> ProcessedVideo:
    """One video's patches, grid and timestamps."""
    from PIL import Image

    frames, metadata = video_frames(data, index)
    count, height, width = frames.shape[:3]
    fps = float(metadata.get("fps") or DEFAULT_FPS)
    indices = [int(i) for i in metadata.get("frames_indices", range(count))]
    if fps <= 0 or len(indices) != count:
        raise ValueError(
            f"multi_modal_data['video'][{index}] metadata: fps must be > 0 and frames_indices "
            f"name each of the {count} frames"
        )
    try:
        new_h, new_w = smart_resize(settings, count, height, width)
    except ValueError as exc:
        raise ValueError(f"multi_modal_data['video'][{index}]: {exc}") from exc
    resized = np.stack(
        [
            np.asarray(Image.fromarray(f).resize((new_w, new_h), Image.Resampling.BICUBIC))
            for f in frames
        ]
    ).astype(np.float32)
    mean = np.asarray(settings.mean, dtype=np.float32)
    std = np.asarray(settings.std, dtype=np.float32)
    video = (resized * np.float32(settings.rescale) - mean) / std  # [T, H, W, C]
    flat, grid = patchify(video, settings)
    return ProcessedVideo(
        torch.from_numpy(np.ascontiguousarray(flat)),
        grid,
        group_timestamps(indices, fps, settings.temporal_patch_size),
    )
