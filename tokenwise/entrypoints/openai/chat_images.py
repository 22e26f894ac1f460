"""The images of a chat request: `image_url` content parts, fetched and decoded, or a 400.

Every problem is the client's to fix and is named: an image sent to a model that reads none,
more images than `--limit-mm-per-prompt` allows, a URL of a kind the server does not fetch, a
local file outside `--allowed-local-media-path` (or no such path configured: local files are
off by default, as in vLLM, since they let a client read the server's disk), a base64 payload
that does not decode, or bytes that are not an image PIL can read. A `video_url` part is
refused by name: decoding a video file needs a video library this server does not have.

Sources: `data:image/...;base64,...` URLs (what the openai client sends for a local image),
`file://` URLs or plain paths under the allowed directory, and http(s) URLs, which the chat
endpoint fetches on the event loop before it prepares the request (`image_fetch.py`,
`prefetch_chat_images`) and hands over here through a context variable (the preparation is
synchronous, and the fetched bytes belong to this request's task alone).
"""

from __future__ import annotations

import base64
import binascii
import io
import os
from contextvars import ContextVar
from typing import Any
from urllib.parse import unquote, urlparse

from tokenwise.entrypoints.openai.errors import OpenAIError
from tokenwise.entrypoints.openai.image_fetch import fetch_images, is_remote
from tokenwise.entrypoints.openai.protocol import ImagePart, VideoPart
from tokenwise.models.registry import is_multimodal_architecture

PARAM = "messages"
# The bytes of the current request's http(s) image URLs, fetched before it is prepared.
FETCHED_IMAGES: ContextVar[dict[str, bytes] | None] = ContextVar("fetched_images", default=None)


def image_parts(messages: list[Any]) -> list[ImagePart]:
    """The request's image parts, in message order."""
    return [
        part
        for m in messages
        if isinstance(m.content, list)
        for part in m.content
        if isinstance(part, ImagePart)
    ]


def check_image_parts(messages: list[Any], supports_images: bool, limit: int | None) -> list:
    """The request's image parts, refused if the model reads none or they are too many."""
    if any(
        isinstance(part, VideoPart)
        for m in messages
        if isinstance(m.content, list)
        for part in m.content
    ):
        # No video library here to decode a clip; offline prompts take decoded frames.
        raise OpenAIError(
            400,
            "video_url content parts are not served: this server decodes no video files; "
            "pass the frames to LLM.generate as multi_modal_data={'video': frames}",
            param=PARAM,
            code="videos_not_supported",
        )
    parts = image_parts(messages)
    if not parts:
        return []
    if not supports_images:
        raise OpenAIError(
            400,
            "this model takes text only: it cannot read the image_url content part(s)",
            param=PARAM,
            code="images_not_supported",
        )
    if limit is not None and len(parts) > limit:
        raise OpenAIError(
            400,
            f"the request has {len(parts)} images, more than the {limit} per prompt this "
            "server allows (--limit-mm-per-prompt)",
            param=PARAM,
            code="too_many_images",
        )
    return parts


async def prefetch_chat_images(
    messages: list[Any],
    supports_images: bool,
    limit: int | None,
    allowed_media_domains: list[str] | None,
) -> dict[str, bytes]:
    """Fetch the request's http(s) image URLs (checked first: no download for a request that
    is refused anyway); the caller puts the result in `FETCHED_IMAGES`."""
    parts = check_image_parts(messages, supports_images, limit)
    return await fetch_images([p.image_url.url for p in parts], allowed_media_domains)


def load_chat_images(
    messages: list[Any],
    supports_images: bool,
    limit: int | None,
    allowed_local_media_path: str | None,
) -> list[Any]:
    """PIL images of the request's image parts (none: an empty list), checked."""
    parts = check_image_parts(messages, supports_images, limit)
    fetched = FETCHED_IMAGES.get()
    return [
        decode_image(read_image_bytes(part.image_url.url, allowed_local_media_path, fetched), i)
        for i, part in enumerate(parts)
    ]


def read_image_bytes(
    url: str, allowed_local_media_path: str | None, fetched: dict[str, bytes] | None = None
) -> bytes:
    if url.startswith("data:"):
        header, sep, payload = url.partition(",")
        if not sep or not header.endswith(";base64"):
            raise OpenAIError(
                400, "an image data URL must be data:<type>;base64,<data>", param=PARAM
            )
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise OpenAIError(
                400, f"the image's base64 data does not decode: {exc}", param=PARAM
            ) from None
    scheme = urlparse(url).scheme
    if is_remote(url):
        if fetched is None or url not in fetched:  # an endpoint that does not prefetch
            raise OpenAIError(
                400, "http(s) image URLs are not fetched by this endpoint", param=PARAM
            )
        return fetched[url]
    if scheme not in ("", "file"):
        raise OpenAIError(
            400,
            f"unsupported image URL scheme {scheme!r}: use http(s), data: or a local file",
            param=PARAM,
        )
    return read_local_file(unquote(urlparse(url).path) if scheme else url, allowed_local_media_path)


def read_local_file(path: str, allowed: str | None) -> bytes:
    """A local image, only from under the allowed directory (symlinks resolved first)."""
    if allowed is None:
        raise OpenAIError(
            400,
            "local image files are off: start the server with --allowed-local-media-path DIR "
            "to read images from DIR",
            param=PARAM,
        )
    root = os.path.realpath(allowed)
    real = os.path.realpath(path)
    if os.path.commonpath([root, real]) != root:
        raise OpenAIError(
            400, f"image path {path!r} is outside --allowed-local-media-path", param=PARAM
        )
    try:
        with open(real, "rb") as f:
            return f.read()
    except OSError as exc:
        raise OpenAIError(
            400, f"cannot read image file {path!r}: {exc.strerror}", param=PARAM
        ) from None


def decode_image(data: bytes, index: int) -> Any:
    """RGB PIL image from encoded bytes (PNG, JPEG, ...); decoded fully here, so a truncated
    file fails now, as a 400, rather than inside the engine."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise OpenAIError(
            400,
            f"image {index} could not be decoded as an image: {exc}",
            param=PARAM,
            code="invalid_image",
        ) from exc


def image_settings(engine: Any) -> tuple[str | None, int | None]:
    """A vision-language engine's image placeholder and per-prompt image limit; (None, None)
    for a model that reads no images. The processor is the engine's own (in this process) or
    the core client's (which processes prompts before sending them to the core)."""
    model_config = engine.model_config
    if not is_multimodal_architecture(model_config.architectures, model_config.limit_mm_per_prompt):
        return None, None
    limit = (model_config.limit_mm_per_prompt or {}).get("image")
    prompts = getattr(engine, "image_prompts", None) or engine.kind.processor
    return prompts.image_token, limit
