"""Images in Qwen2.5-VL prompts: any size, so each image has its own number of tokens.

The checkpoint's image processor (`Qwen2VLImageProcessor`, its PIL/numpy implementation:
the fast one needs torchvision) resizes an image to multiples of `patch_size *
merge_size` within its pixel budget, keeping the aspect ratio, and cuts it into flattened
patches; `image_grid_thw` says how many frames, rows and columns of patches it has. The
prompt's placeholder (`<|image_pad|>`, normally between `<|vision_start|>` and
`<|vision_end|>`) is expanded into one token per merged block of patches, as HF's
`Qwen2_5_VLProcessor` does, and the text is tokenized with the checkpoint's tokenizer.
HF's processor itself is not used: transformers refuses to build it without its video
processor, which needs torchvision.

Each image becomes an `ImageInput` with its grid; its hash covers the pixels and the grid.
"""

from __future__ import annotations

from typing import Any

from tokenwise.engine.kinds.image_inputs import (
    PREPROCESSOR_FILES,
    ImageInput,
    check_placeholders,
    grid_runs,
)
from tokenwise.engine.kinds.video_prompts import VideoPrompts

Grid = tuple[int, int, int]


def load_image_processor(model_dir: str) -> Any:
    """The checkpoint's Qwen2-VL image processor, the PIL/numpy one (5.x: `...Pil`; 4.x: the
    slow class)."""
    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil as ImageProcessor,
        )
    except ImportError:  # transformers 4.x
        from transformers import Qwen2VLImageProcessor as ImageProcessor  # type: ignore[no-redef]
    try:
        return ImageProcessor.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"could not load the image processor of {model_dir!r} ({exc}); a "
            f"vision-language checkpoint needs its processor files "
            f"({', '.join(PREPROCESSOR_FILES)}) next to the weights"
        ) from exc


class GridImagePrompts:
    """Turns prompts with images into token ids and `ImageInput`s (one per engine)."""

    def __init__(
        self,
        model_dir: str,
        tokenizer: Any,
        image_token_id: int,
        merge_size: int,
        video_tokens: dict[str, int] | None = None,
    ) -> None:
        self.model_dir = model_dir
        self.tokenizer = tokenizer
        self.image_token_id = image_token_id
        self.merge_size = merge_size
        self.image_token = str(tokenizer.convert_ids_to_tokens(image_token_id))
        self._processor: Any = None
        # Qwen3.5: videos too (`video_prompts.py`); the video, vision start and end tokens.
        self.videos = VideoPrompts(model_dir, tokenizer, video_tokens) if video_tokens else None

    @property
    def processor(self) -> Any:
        """The image processor, loaded when the first image arrives."""
        if self._processor is None:
            self._processor = load_image_processor(self.model_dir)
        return self._processor

    def split_and_process(self, text: str, images: list[Any]) -> tuple[list[str], Any]:
        """The text around each placeholder (one per image, checked) and the image
        processor's batch for the images."""
        pieces = text.split(self.image_token)
        check_placeholders(len(pieces) - 1, len(images), self.image_token, "image")
        try:
            batch = self.processor(
                images=[image.convert("RGB") for image in images], return_tensors="pt"
            )
        except (ValueError, OSError, TypeError) as exc:
            raise ValueError(f"the image processor refused the input: {exc}") from exc
        return pieces, batch

    def process(
        self, text: str, images: list[Any], videos: list[Any] | None = None
    ) -> tuple[list[int], list[ImageInput]]:
        """Token ids of `text` with each image's (and video's) placeholder expanded, and the
        images and videos' temporal groups, in prompt order."""
        processed: list[Any] = []
        if videos:
            if self.videos is None:
                raise ValueError("this model reads images only, not videos")
            text, processed = self.videos.expand(text, videos, self.processor)
        grids: list[Grid] = []
        pixels: list[Any] = []
        pieces = [text]
        if images or self.image_token in text:
            pieces, batch = self.split_and_process(text, images)
            grids = [(int(t), int(h), int(w)) for t, h, w in batch["image_grid_thw"].tolist()]
            pixels = list(batch["pixel_values"].split([t * h * w for t, h, w in grids]))
        counts = [t * h * w // self.merge_size**2 for t, h, w in grids]
        expanded = pieces[0]
        for count, piece in zip(counts, pieces[1:], strict=True):
            expanded += self.image_token * count + piece
        ids = [int(t) for t in self.tokenizer(expanded)["input_ids"]]
        found = self.locate(ids, pixels, grids, counts)
        if self.videos is not None:
            found += self.videos.locate(ids, processed, self.merge_size)
        return ids, sorted(found, key=lambda item: item.offset)

    def locate(
        self, ids: list[int], pixels: list[Any], grids: list[Grid], counts: list[int]
    ) -> list[ImageInput]:
        """Each image's run of placeholder tokens, in order; they must be whole runs."""
        items = list(zip(pixels, grids, counts, strict=True))
        return grid_runs(ids, self.image_token_id, self.image_token, "image", items)
