"""Images in `/v1/chat/completions` through the official `openai` client against `tokenwise
serve` with a tiny LLaVA checkpoint (`tests/models/_tiny_llava.py`).

The expected answer is `LLM.generate` on the prompt the chat template renders and the same
image (a PNG, so decoding is lossless on both sides); `LLM.generate` itself is checked against
HF in tests/models/test_llava.py. A second server with a text-only model checks that images
are refused there.
"""

from __future__ import annotations

import base64
import io
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import openai
import pytest
from openai import OpenAI
from PIL import Image

from tests.entrypoints._server import RemoteServer, openai_client, wait_for_idle
from tests.models._tiny_llava import build_tiny_llava, llava_tokenizer, make_image
from tests.tiny_checkpoints import build_tiny_checkpoint
from tokenwise.entrypoints.llm import LLM
from tokenwise.sampling.params import SamplingParams

NAME = "tiny-llava"
MAX_TOKENS = 8
FETCH_TIMEOUT_S = 1.0
FETCH_MAX_MB = 0.05  # 52428 bytes


def png(image: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def image_message(*urls: str, text: str = "What is in the picture?") -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [{"role": "user", "content": parts}]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, str]:
    root = tmp_path_factory.mktemp("vlm")
    media = root / "media"
    media.mkdir()
    (media / "cat.png").write_bytes(png(make_image(7, 48, 40)))
    (root / "secret.png").write_bytes(png(make_image(8, 20, 20)))
    text_model = build_tiny_checkpoint(root / "text")
    return build_tiny_llava(str(root / "llava")), str(media), text_model


class ImageHost(BaseHTTPRequestHandler):
    """A tiny image server: the PNG, a slow one, a huge one, a 404, an HTML page, a redirect."""

    image = b""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        path = self.path
        if path == "/slow.png":
            time.sleep(FETCH_TIMEOUT_S * 3)
        if path in ("/cat.png", "/slow.png"):
            self._reply(200, "image/png", self.image)
        elif path == "/huge.png":
            self._reply(200, "image/png", b"\0" * int(FETCH_MAX_MB * 1024 * 1024 * 3))
        elif path == "/page.html":
            self._reply(200, "text/html; charset=utf-8", b"<html>not an image</html>")
        else:
            self._reply(404, "text/plain", b"no such image")

    def _reply(self, status: int, kind: str, body: bytes) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):  # the engine gave up on it
            pass

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def image_host(dirs: tuple[str, str, str]):
    """Base URL of a local HTTP server (127.0.0.1, a thread of this process)."""
    ImageHost.image = png(make_image(7, 48, 40))
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), ImageHost)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def servers(dirs: tuple[str, str, str]):
    model, media, text_model = dirs
    with (
        RemoteServer(
            model,
            "--served-model-name",
            NAME,
            "--limit-mm-per-prompt",
            '{"image": 2}',
            "--allowed-local-media-path",
            media,
            "--allowed-media-domains",
            "127.0.0.1",
            env={
                "TOKENWISE_IMAGE_FETCH_TIMEOUT": str(FETCH_TIMEOUT_S),
                "TOKENWISE_IMAGE_FETCH_MAX_MB": str(FETCH_MAX_MB),
            },
            wait=False,
        ) as vlm,
        RemoteServer(text_model, "--served-model-name", "text", wait=False) as text,
    ):
        yield vlm.wait_healthy(), text.wait_healthy()


@pytest.fixture(scope="module")
def client(servers: tuple[RemoteServer, RemoteServer]) -> OpenAI:
    return openai_client(servers[0])


def offline_answer(model_dir: str, messages: list[dict[str, Any]], images: list[Any]) -> str:
    # The template's multimodal form: an image part is {"type": "image"}.
    hf_messages = [
        {
            "role": m["role"],
            "content": [{"type": "image"} if p["type"] == "image_url" else p for p in m["content"]],
        }
        for m in messages
    ]
    prompt = llava_tokenizer().apply_chat_template(
        hf_messages, tokenize=False, add_generation_prompt=True
    )
    llm = LLM(model_dir, dtype="float32", num_gpu_blocks=32, block_size=8, max_model_len=256)
    out = llm.generate(
        {"prompt": prompt, "multi_modal_data": {"image": images}},
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
        use_tqdm=False,
    )
    return out[0].outputs[0].text


def chat(client: OpenAI, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model=NAME, messages=messages, max_completion_tokens=MAX_TOKENS, temperature=0, **kwargs
    )


def test_base64_image_answer_equals_offline(
    client: OpenAI, dirs: tuple[str, str, str], servers: Any
) -> None:
    model_dir, media, _ = dirs
    image = Image.open(os.path.join(media, "cat.png")).convert("RGB")
    other = make_image(3, 64, 30)
    messages = image_message(data_url(png(image)), data_url(png(other)))
    reply = chat(client, messages)
    expected = offline_answer(model_dir, messages, [image, other])
    assert reply.choices[0].message.content == expected
    assert reply.usage.prompt_tokens > 32  # two images of 16 placeholder tokens each
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in chat(client, messages, stream=True)
        if chunk.choices
    )
    assert streamed == expected
    # A local file under --allowed-local-media-path reads as the same image.
    local = chat(client, image_message(os.path.join(media, "cat.png"), data_url(png(other))))
    assert local.choices[0].message.content == expected
    # Another image, the same text: another answer (the images reach the model).
    assert (
        chat(client, image_message(data_url(png(other)), data_url(png(image))))
        .choices[0]
        .message.content
        != expected
    )
    wait_for_idle(servers[0])


def test_a_failed_fetch_answers_without_waiting_for_the_others(
    client: OpenAI, image_host: str
) -> None:
    started = time.monotonic()
    with pytest.raises(openai.BadRequestError, match="HTTP 404"):
        chat(client, image_message(f"{image_host}/slow.png", f"{image_host}/missing.png"))
    assert time.monotonic() - started < FETCH_TIMEOUT_S  # the slow fetch was dropped


def test_images_travel_to_the_engine_core_process(
    client: OpenAI, dirs: tuple[str, str, str], servers: Any
) -> None:
    """The server's engine runs in a core process: the client processes images and sends the
    pixels; a prompt the processor refuses is a 400 from the front end, and the core keeps
    serving (its answer is checked against the in-process engine above)."""
    from tests.entrypoints.test_engine_core_death import _engine_core_pid

    core = _engine_core_pid(servers[0].proc.pid)
    good = image_message(data_url(ImageHost.image or png(make_image(7, 48, 40))))
    before = chat(client, good).choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="could not be decoded as an image"):
        chat(client, image_message("data:image/png;base64,bm90IGFuIGltYWdl"))
    with pytest.raises(openai.BadRequestError, match="image placeholder token but no image"):
        chat(client, [{"role": "user", "content": "a <image> without its image"}])
    assert chat(client, good).choices[0].message.content == before
    assert _engine_core_pid(servers[0].proc.pid) == core  # the same core, still alive
    wait_for_idle(servers[0])


def test_models_lists_image_input(servers: tuple[RemoteServer, RemoteServer]) -> None:
    import httpx

    vlm, text = servers
    cards = httpx.get(vlm.url("/v1/models")).json()["data"]
    assert cards[0]["input_modalities"] == ["text", "image"]
    assert httpx.get(text.url("/v1/models")).json()["data"][0]["input_modalities"] == ["text"]


@pytest.mark.parametrize(
    ("urls", "match"),
    [
        (["data:image/png;base64,bm90IGFuIGltYWdl"], "could not be decoded as an image"),
        (["data:image/png;base64,@@@"], "base64 data does not decode"),
        (["data:image/png,plain"], "data:<type>;base64"),
        (["ftp://example.com/cat.png"], "unsupported image URL scheme 'ftp'"),
        (["SECRET"], "outside --allowed-local-media-path"),
        (["A", "A", "A"], "3 images, more than the 2 per prompt"),
    ],
    ids=["not-an-image", "bad-base64", "not-base64", "ftp", "outside-media-path", "too-many"],
)
def test_bad_images_are_400s_naming_the_problem(
    client: OpenAI, dirs: tuple[str, str, str], urls: list[str], match: str
) -> None:
    _, media, _ = dirs
    good = data_url(png(make_image(1, 10, 10)))
    secret = os.path.join(os.path.dirname(media), "secret.png")
    urls = [good if u == "A" else secret if u == "SECRET" else u for u in urls]
    with pytest.raises(openai.BadRequestError, match=match.replace("(", r"\(").replace(")", r"\)")):
        chat(client, image_message(*urls))


def test_http_image_answer_equals_data_url(client: OpenAI, image_host: str, servers: Any) -> None:
    other = data_url(png(make_image(3, 64, 30)))
    expected = chat(client, image_message(data_url(ImageHost.image), other))
    fetched = chat(client, image_message(f"{image_host}/cat.png", other))
    assert fetched.choices[0].message.content == expected.choices[0].message.content
    assert fetched.usage.prompt_tokens == expected.usage.prompt_tokens
    wait_for_idle(servers[0])


@pytest.mark.parametrize(
    ("path", "match", "code"),
    [
        ("/slow.png", f"took longer than {FETCH_TIMEOUT_S:g} s", "image_fetch_timeout"),
        ("/huge.png", "more than the 52428 bytes", "image_too_large"),
        ("/page.html", "'text/html' content, not an image", "invalid_image"),
        ("/missing.png", "HTTP 404", "image_fetch_failed"),
        ("LOCALHOST", "'localhost' is not in --allowed-media-domains", "media_domain_not_allowed"),
    ],
    ids=["timeout", "too-large", "html", "404", "domain"],
)
def test_bad_http_images_are_400s_naming_the_problem(
    client: OpenAI, servers: Any, image_host: str, path: str, match: str, code: str
) -> None:
    url = image_host + path
    if path == "LOCALHOST":
        url = image_host.replace("127.0.0.1", "localhost") + "/cat.png"
    result: dict[str, Any] = {}

    def request() -> None:
        try:
            chat(client, image_message(url))
        except openai.BadRequestError as exc:
            result["error"] = exc

    worker = threading.Thread(target=request)
    started = time.monotonic()
    worker.start()
    if path == "/slow.png":  # the server keeps serving while the fetch waits
        import httpx

        assert httpx.get(servers[0].url("/v1/models"), timeout=5).status_code == 200
        assert time.monotonic() - started < FETCH_TIMEOUT_S
    worker.join(timeout=30)
    error = result.get("error")
    assert error is not None, f"{url} was not refused"
    assert match in str(error)
    assert error.code == code


def test_text_only_model_refuses_images(servers: tuple[RemoteServer, RemoteServer]) -> None:
    text_client = openai_client(servers[1])
    with pytest.raises(openai.BadRequestError, match="takes text only") as info:
        text_client.chat.completions.create(
            model="text",
            messages=image_message(data_url(png(make_image(1, 10, 10)))),
            max_completion_tokens=4,
        )
    assert info.value.code == "images_not_supported"


def test_video_url_parts_are_refused_by_name(client: OpenAI) -> None:
    """No video library decodes a clip here: a `video_url` part is a 400 naming it."""
    part = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}
    with pytest.raises(
        openai.BadRequestError, match="video_url content parts are not served"
    ) as info:
        chat(client, [{"role": "user", "content": [part, {"type": "text", "text": "Hi"}]}])
    assert info.value.code == "videos_not_supported"


@pytest.mark.parametrize("multimodal_template", [True, False], ids=["parts", "string"])
def test_chat_template_of_either_form_places_the_images(multimodal_template: bool) -> None:
    """A template that renders Hugging Face's image parts writes the placeholders itself; one
    that reads `content` as a string gets the placeholder where each image was."""
    import copy

    from tests.tiny_checkpoints import tiny_tokenizer
    from tokenwise.entrypoints.openai.chat_rendering import render_chat
    from tokenwise.entrypoints.openai.protocol import ChatCompletionRequest

    tokenizer = llava_tokenizer() if multimodal_template else copy.deepcopy(tiny_tokenizer())
    body = ChatCompletionRequest(
        messages=image_message("data:,a", "data:,b", text="Two:"), model=NAME
    )
    prompt = render_chat(tokenizer, body, "<image>", 2)["prompt"]
    expected = "Two:<image><image>" if multimodal_template else "Two:\n<image>\n<image>"
    assert prompt == f"<|user|>{expected}\n<|assistant|>"


@pytest.mark.parametrize(
    ("name", "value"),
    [("TOKENWISE_IMAGE_FETCH_TIMEOUT", "soon"), ("TOKENWISE_IMAGE_FETCH_MAX_MB", "0")],
)
def test_bad_fetch_limits_are_refused_by_name(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    from tokenwise.entrypoints.openai.image_fetch import fetch_limits

    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"{name} must be a number > 0, got '{value}'"):
        fetch_limits()
