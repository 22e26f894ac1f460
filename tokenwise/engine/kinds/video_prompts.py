"""Videos in Qwen3.5 prompts: each video's placeholder expanded into its frames, and each
temporal group of frames made one `ImageInput`.

Qwen3-VL-style models separate a video's temporal groups with their timestamps: the prompt's
`<|vision_start|><|video_pad|><|vision_end|>` (or a bare `<|video_pad|>`) becomes, per group,
`<{seconds:.1f} seconds><|vision_start|>` + one `<|video_pad|>` per merged block of patches +
`<|vision_end|>` (the original Qwen3-VL processor's and vLLM's expansion; transformers 5
replaces the bare token only, which nests the markers). The model places each group as an
image of one frame (HF's `get_rope_index` splits `video_grid_thw` into `t` grids of one
frame), so a group is an `ImageInput` with `grid_thw = (1, rows, cols)` and everything the
engine does for images holds for it unchanged: the tower runs it with the step's images
(frames attend within themselves, so a group's rows do not depend on the others), the
encoder budget counts it, a chunk may stop inside it, and its content hash keys the prefix
cache and the encoder cache (a still video's equal groups are encoded once).
"""

from __future__ import annotations

from typing import Any

from PIL import Image

from tokenwise.engine.kinds.image_inputs import ImageInput, check_placeholders, grid_runs
from tokenwise.engine.kinds.video_inputs import ProcessedVideo, VideoSettings, process_video


def as_video_list(data: Any) -> list[Any]:
    """`multi_modal_data["video"]`: one video (an array, a list of PIL frames, or `(frames,
    metadata)`) or a list of them."""
    if isinstance(data, list) and data and not all(isinstance(f, Image.Image) for f in data):
        return data
    return [data]


class VideoPrompts:
    """Expands and locates the videos of prompts (one per engine)."""

    def __init__(self, model_dir: str, tokenizer: Any, token_ids: dict[str, int]) -> None:
        self.model_dir = model_dir
        self.video_token_id = token_ids["video"]
        name = tokenizer.convert_ids_to_tokens
        self.video_token = str(name(token_ids["video"]))
        self.start, self.end = str(name(token_ids["start"])), str(name(token_ids["end"]))
        self._settings: VideoSettings | None = None

    def settings(self, image_processor: Any) -> VideoSettings:
        if self._settings is None:
            self._settings = VideoSettings.of_checkpoint(self.model_dir, image_processor)
        return self._settings

    def expand(
        self, text: str, videos: list[Any], image_processor: Any
    ) -> tuple[str, list[ProcessedVideo]]:
        """`text` with each video's placeholder expanded, and the processed videos."""
        check_placeholders(text.count(self.video_token), len(videos), self.video_token, "video")
        settings = self.settings(image_processor)
        processed = [process_video(settings, video, i) for i, video in enumerate(videos)]
        done: list[str] = []  # the expanded text so far; only the rest is searched again
        for video in processed:
            _, rows, cols = video.grid_thw
            per_group = self.video_token * (rows * cols // settings.merge_size**2)
            head, _, text = text.partition(self.video_token)
            if head.endswith(self.start) and text.startswith(self.end):  # the whole marker
                head, text = head[: -len(self.start)], text[len(self.end) :]
            done.append(head)
            done.extend(
                f"<{seconds:.1f} seconds>{self.start}{per_group}{self.end}"
                for seconds in video.timestamps
            )
        out = "".join(done) + text
        return out, processed

    def locate(self, ids: list[int], videos: list[ProcessedVideo], merge: int) -> list[ImageInput]:
        """Each temporal group's run of video placeholder tokens, in order."""
        items = []
        for video in videos:
            _, rows, cols = video.grid_thw
            items += [
                (pixels, (1, rows, cols), rows * cols // merge**2) for pixels in video.groups()
            ]
        return grid_runs(ids, self.video_token_id, self.video_token, "video", items)
