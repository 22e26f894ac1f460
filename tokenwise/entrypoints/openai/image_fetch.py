"""http(s) image URLs of a chat request, fetched on the event loop without blocking it.

A URL names a server somebody else runs, so every fetch is bounded: a time limit for the whole
download (`TOKENWISE_IMAGE_FETCH_TIMEOUT`, seconds, default 5, vLLM's
`VLLM_IMAGE_FETCH_TIMEOUT`), a size limit (`TOKENWISE_IMAGE_FETCH_MAX_MB`, default 20; the
body is read in chunks and the download stops as soon as it passes the limit, whatever the
`Content-Length` claims), and, with `--allowed-media-domains` (vLLM's flag), a list of the
hosts it may reach, checked on every redirect too (`TOKENWISE_MEDIA_URL_ALLOW_REDIRECTS=0`,
vLLM's `VLLM_MEDIA_URL_ALLOW_REDIRECTS`, refuses redirects altogether). A response that says it
is not an image (`Content-Type` other than `image/*` or a bare `application/octet-stream`) and
an HTTP error status are refused. Each problem is a 400 that names it: the client sent the URL.

The download uses `httpx.AsyncClient` (httpx, a small pure-Python dependency), so a slow image server holds only its own request; the request's images are
fetched concurrently. The bytes are decoded later, with the request's other images
(`chat_images.py`).
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlparse

import httpx

from tokenwise import envs
from tokenwise.entrypoints.openai.errors import OpenAIError

PARAM = "messages"
ENV_TIMEOUT = "TOKENWISE_IMAGE_FETCH_TIMEOUT"
ENV_MAX_MB = "TOKENWISE_IMAGE_FETCH_MAX_MB"
ENV_REDIRECTS = "TOKENWISE_MEDIA_URL_ALLOW_REDIRECTS"
DEFAULT_TIMEOUT_S = 5.0
DEFAULT_MAX_MB = 20.0
NEUTRAL_TYPES = ("application/octet-stream", "binary/octet-stream")


def is_remote(url: str) -> bool:
    return urlparse(url).scheme in ("http", "https")


def _env_float(name: str, default: float) -> float:
    raw = envs.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ValueError(f"{name} must be a number > 0, got {raw!r}")
    return value


def fetch_limits() -> tuple[float, int, bool]:
    """(timeout in seconds, size limit in bytes, follow redirects) from the environment."""
    timeout = _env_float(ENV_TIMEOUT, DEFAULT_TIMEOUT_S)
    max_bytes = int(_env_float(ENV_MAX_MB, DEFAULT_MAX_MB) * 1024 * 1024)
    redirects = envs.get(ENV_REDIRECTS).strip().lower() not in ("0", "false")
    return timeout, max_bytes, redirects


def check_domain(url: str, allowed: list[str] | None) -> None:
    """Refuse a URL whose host is not one of `allowed` (None: any host)."""
    if allowed is None:
        return
    host = (urlparse(url).hostname or "").lower()
    if host not in {d.lower() for d in allowed}:
        raise OpenAIError(
            400,
            f"image URL host {host!r} is not in --allowed-media-domains ({', '.join(allowed)})",
            param=PARAM,
            code="media_domain_not_allowed",
        )


async def fetch_images(urls: list[str], allowed_domains: list[str] | None) -> dict[str, bytes]:
    """The bytes behind each distinct http(s) URL of `urls` (others are skipped), or a 400."""
    remote = list(dict.fromkeys(u for u in urls if is_remote(u)))
    if not remote:
        return {}
    for url in remote:
        check_domain(url, allowed_domains)
    timeout, max_bytes, redirects = fetch_limits()

    async def on_request(request: httpx.Request) -> None:  # every hop, redirects included
        check_domain(str(request.url), allowed_domains)

    async with httpx.AsyncClient(
        follow_redirects=redirects,
        timeout=httpx.Timeout(timeout),
        event_hooks={"request": [on_request]},
    ) as client:
        tasks = [asyncio.ensure_future(_fetch_one(client, u, timeout, max_bytes)) for u in remote]
        try:
            bodies = await asyncio.gather(*tasks)
        except BaseException:
            # One failed (its 400 is the answer): stop the others before the client closes.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
    return dict(zip(remote, bodies, strict=True))


async def _fetch_one(client: httpx.AsyncClient, url: str, timeout: float, max_bytes: int) -> bytes:
    try:
        return await asyncio.wait_for(_download(client, url, max_bytes), timeout)
    except (TimeoutError, asyncio.TimeoutError):
        raise OpenAIError(
            400,
            f"fetching image URL {url!r} took longer than {timeout:g} s ({ENV_TIMEOUT})",
            param=PARAM,
            code="image_fetch_timeout",
        ) from None


async def _download(client: httpx.AsyncClient, url: str, max_bytes: int) -> bytes:
    try:
        async with client.stream("GET", url) as response:
            if response.is_redirect:
                raise OpenAIError(
                    400,
                    f"image URL {url!r} redirects, and redirects are off ({ENV_REDIRECTS}=0)",
                    param=PARAM,
                )
            if response.status_code >= 400:
                raise OpenAIError(
                    400,
                    f"fetching image URL {url!r} failed: HTTP {response.status_code} "
                    f"{response.reason_phrase}",
                    param=PARAM,
                    code="image_fetch_failed",
                )
            kind = response.headers.get("content-type", "").split(";")[0].strip().lower()
            if kind and not kind.startswith("image/") and kind not in NEUTRAL_TYPES:
                raise OpenAIError(
                    400,
                    f"image URL {url!r} returned {kind!r} content, not an image",
                    param=PARAM,
                    code="invalid_image",
                )
            body = bytearray()
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > max_bytes:
                    raise OpenAIError(
                        400,
                        f"image URL {url!r} returned more than the {max_bytes} bytes an image "
                        f"may have ({ENV_MAX_MB}={max_bytes / 1024 / 1024:g})",
                        param=PARAM,
                        code="image_too_large",
                    )
            return bytes(body)
    except httpx.TimeoutException:
        raise OpenAIError(
            400,
            f"fetching image URL {url!r} timed out ({ENV_TIMEOUT})",
            param=PARAM,
            code="image_fetch_timeout",
        ) from None
    except httpx.HTTPError as exc:
        raise OpenAIError(
            400, f"fetching image URL {url!r} failed: {exc}", param=PARAM, code="image_fetch_failed"
        ) from None
