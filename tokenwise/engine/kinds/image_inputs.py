"""Images in prompts: the checkpoint's own HF processor, placeholders, and content hashes.

A prompt `{"prompt": "... <image> ...", "multi_modal_data": {"image": img or [imgs]}}` (vLLM's
form) goes through the checkpoint's `AutoProcessor` (LLaVA: `LlavaProcessor` with a
`CLIPImageProcessor`), so tokenwise reads exactly the pixels and token ids HF would: the
image processor resizes, crops and normalises each image, and the processor expands each
`<image>` into the model's number of placeholder tokens. The slow (PIL/numpy) image
processor is asked for (`use_fast=False`; `backend="pil"` in transformers 5): the fast one
needs torchvision.

Each image becomes an `ImageInput`: where its placeholder run starts in the prompt, how long
it is, its pixel values, and a hash of them. The hash names the image's content wherever the
engine must tell images apart: the prefix cache (a block covering placeholder tokens is keyed
by the hashes of the images there, so equal text with another image never shares a block)
and the runner's encoder cache (an image's embeddings, computed once).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

PREPROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One image of a prompt: placeholder tokens `offset : offset + length`."""

    offset: int
    length: int
    content_hash: bytes
    # LLaVA: [channels, height, width]; Qwen2.5-VL: [patches, flattened patch]
    pixel_values: torch.Tensor
    # Frames, rows and columns of patches (Qwen2.5-VL, whose images keep their aspect).
    grid_thw: tuple[int, int, int] | None = None

    @property
    def end(self) -> int:
        return self.offset + self.length


def hash_pixels(pixel_values: torch.Tensor, layout: str = "") -> bytes:
    """sha256 of the processed pixels (shape, dtype and `layout`, e.g. a patch grid,
    included): equal digests, equal embeddings, whatever file or size the image came from."""
    array = pixel_values.detach().cpu().contiguous()
    digest = hashlib.sha256(f"{tuple(array.shape)}|{array.dtype}|{layout}|".encode())
    digest.update(array.numpy().tobytes())
    return digest.digest()


def as_image_list(data: Any) -> list[Any]:
    """`multi_modal_data["image"]` as a list of PIL images, checked."""
    from PIL import Image

    images = list(data) if isinstance(data, (list, tuple)) else [data]
    for i, image in enumerate(images):
        if not isinstance(image, Image.Image):
            raise ValueError(
                f"multi_modal_data['image'][{i}] must be a PIL.Image.Image, got "
                f"{type(image).__name__}"
            )
        if image.width < 1 or image.height < 1:
            raise ValueError(f"image {i} is empty ({image.width}x{image.height})")
    return images


class ImagePrompts:
    """Turns prompts with images into token ids and `ImageInput`s (one per engine)."""

    def __init__(self, model_dir: str, image_token_id: int, tokens_per_image: int) -> None:
        self.model_dir = model_dir
        self.image_token_id = image_token_id
        self.tokens_per_image = tokens_per_image
        self._processor: Any = None

    @property
    def processor(self) -> Any:
        """The checkpoint's processor, loaded when the first image arrives."""
        if self._processor is None:
            import transformers

            # The PIL/numpy image processor: `backend="pil"` in 5.x, `use_fast=False` before.
            major = int(transformers.__version__.split(".")[0])
            slow = {"backend": "pil"} if major >= 5 else {"use_fast": False}
            try:
                self._processor = transformers.AutoProcessor.from_pretrained(
                    self.model_dir, local_files_only=True, **slow
                )
            except (OSError, ValueError) as exc:
                raise ValueError(
                    f"could not load the image processor of {self.model_dir!r} ({exc}); a "
                    "vision-language checkpoint needs its processor files "
                    f"({', '.join(PREPROCESSOR_FILES)}) next to the weights"
                ) from exc
        return self._processor

    @property
    def image_token(self) -> str:
        token = getattr(self.processor, "image_token", None)
        return token if isinstance(token, str) else "<image>"

    def process(self, text: str, images: list[Any]) -> tuple[list[int], list[ImageInput]]:
        """Token ids of `text` with each image's placeholder expanded, and the images."""
        check_placeholders(text.count(self.image_token), len(images), self.image_token, "image")
        try:
            batch = self.processor(
                images=[image.convert("RGB") for image in images],
                text=text,
                return_tensors="pt",
            )
        except (ValueError, OSError, TypeError) as exc:
            raise ValueError(f"the image processor refused the input: {exc}") from exc
        ids = [int(t) for t in batch["input_ids"][0].tolist()]
        pixel_values = batch["pixel_values"]
        return ids, self.locate(ids, list(pixel_values))

    def locate(self, ids: list[int], pixel_values: list[torch.Tensor]) -> list[ImageInput]:
        """Each image's run of placeholder tokens, in order; they must be whole runs."""
        where = np.flatnonzero(np.asarray(ids) == self.image_token_id)
        n = self.tokens_per_image
        if len(where) != n * len(pixel_values):
            raise ValueError(
                f"the prompt holds {len(where)} image placeholder tokens, but "
                f"{len(pixel_values)} image(s) of {n} tokens each need {n * len(pixel_values)}"
            )
        images = []
        for i, pixels in enumerate(pixel_values):
            run = where[i * n : (i + 1) * n]
            if run[-1] - run[0] != n - 1:
                raise ValueError(f"image {i}'s placeholder tokens are not contiguous")
            images.append(ImageInput(int(run[0]), n, hash_pixels(pixels), pixels))
        return images


def check_placeholders(found: int, given: int, token: str, what: str) -> None:
    """One placeholder `token` in the prompt per `what` ("image", "video") given."""
    if found != given:
        raise ValueError(
            f"the prompt has {found} {what} placeholder(s) ({token!r}) but {given} {what}(s) "
            f"were given; put one {token!r} where each {what} goes"
        )


def grid_runs(
    ids: list[int], token_id: int, token: str, what: str, items: list[tuple[Any, Any, int]]
) -> list[ImageInput]:
    """Each item's run of `token_id` placeholders, in order, as an `ImageInput`; `items` are
    `(pixels, grid_thw, tokens)` (an image, or a video's temporal group). The runs must be
    whole and the prompt must hold no other placeholder."""
    where = np.flatnonzero(np.asarray(ids) == token_id)
    need = sum(count for *_, count in items)
    if len(where) != need:
        raise ValueError(
            f"the prompt holds {len(where)} {what} placeholder tokens, but its {what}s need "
            f"{need} ({token!r} may appear in the text only as a placeholder)"
        )
    out, start = [], 0
    for i, (pixels, grid, count) in enumerate(items):
        run = where[start : start + count]
        if run[-1] - run[0] != count - 1:
            raise ValueError(f"{what} {i}'s placeholder tokens are not contiguous")
        content = hash_pixels(pixels, layout=f"grid{grid}")
        out.append(ImageInput(int(run[0]), count, content, pixels, grid))
        start += count
    return out


def hash_spans(images: list[ImageInput]) -> tuple[tuple[int, int, bytes], ...]:
    """`(offset, length, hash)` of each image: the extra keys of the blocks they cover."""
    return tuple((im.offset, im.length, im.content_hash) for im in images)
