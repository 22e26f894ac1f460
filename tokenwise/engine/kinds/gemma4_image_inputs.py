"""Images in Gemma 4 prompts: each image keeps its aspect ratio, so each has its own number of
soft tokens.

The checkpoint's image processor (`Gemma4ImageProcessorPil`) resizes an image to the largest
grid of `patch_size` squares within its patch budget (`max_soft_tokens *
pooling_kernel_size^2`) whose sides are multiples of `pooling_kernel_size`, flattens each
patch and pads the batch to the budget (padding patches at position (-1, -1)). One image
becomes `rows * cols / pooling_kernel_size^2` soft tokens; each `<|image|>` of the prompt is
expanded into `<|image>`, that many soft tokens and `<image|>`, as HF's `Gemma4Processor` does,
and the text is tokenized with the checkpoint's tokenizer. HF's processor itself is not used:
transformers refuses to build it without its video processor, which needs torchvision.

An `ImageInput` keeps the image's real patches (the padding dropped) and its `(1, rows, cols)`
patch grid, from which the tower rebuilds each patch's position.
"""

from __future__ import annotations

from typing import Any

from tokenwise.engine.kinds.grid_image_inputs import GridImagePrompts
from tokenwise.engine.kinds.image_inputs import PREPROCESSOR_FILES, ImageInput


def load_gemma4_image_processor(model_dir: str) -> Any:
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    try:
        return Gemma4ImageProcessorPil.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"could not load the image processor of {model_dir!r} ({exc}); a vision-language "
            f"checkpoint needs its processor files ({', '.join(PREPROCESSOR_FILES)}) next to "
            "the weights"
        ) from exc


class Gemma4ImagePrompts(GridImagePrompts):
    """Turns prompts with images into token ids and `ImageInput`s (one per engine)."""

    def __init__(self, model_dir: str, tokenizer: Any, mm_config: Any) -> None:
        super().__init__(model_dir, tokenizer, int(mm_config.image_token_id), 1)
        self.vision_config = mm_config.vision_config
        self.boi_token = str(tokenizer.convert_ids_to_tokens(int(mm_config.boi_token_id)))
        self.eoi_token = str(tokenizer.convert_ids_to_tokens(int(mm_config.eoi_token_id)))

    @property
    def processor(self) -> Any:
        """The image processor, loaded (and checked against the tower) at the first image."""
        if self._processor is None:
            processor = load_gemma4_image_processor(self.model_dir)
            for name in ("patch_size", "pooling_kernel_size"):
                ours, theirs = getattr(processor, name), getattr(self.vision_config, name)
                if int(ours) != int(theirs):
                    raise ValueError(
                        f"the image processor of {self.model_dir!r} has {name}={ours} but the "
                        f"vision tower's config says {theirs}"
                    )
            self._processor = processor
        return self._processor

    def process(self, text: str, images: list[Any]) -> tuple[list[int], list[ImageInput]]:
        """Token ids of `text` with each image's placeholder expanded, and the images."""
        pieces, batch = self.split_and_process(text, images)
        kernel = int(self.processor.pooling_kernel_size)
        grids, pixels, counts = [], [], []
        for patches, positions in zip(
            batch["pixel_values"], batch["image_position_ids"], strict=True
        ):
            real = int((positions[:, 0] >= 0).sum())
            cols, rows = (int(v) + 1 for v in positions[:real].max(dim=0).values)
            grids.append((1, rows, cols))
            pixels.append(patches[:real])
            counts.append(rows * cols // kernel**2)
        expanded = pieces[0]
        for count, piece in zip(counts, pieces[1:], strict=True):
            expanded += self.boi_token + self.image_token * count + self.eoi_token + piece
        ids = [int(t) for t in self.tokenizer(expanded)["input_ids"]]
        return ids, self.locate(ids, pixels, grids, counts)
