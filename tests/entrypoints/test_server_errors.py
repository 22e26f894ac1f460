"""Every way a request can be refused, over raw HTTP: status code and OpenAI's error body.

The server runs with small caps (so "over the cap" is cheap to send), an API key,
`--strict-request-fields` (unknown fields are 400s; the default ignores them, see
test_server_compat.py) and a tokenizer without a chat template. The last test checks it still serves a valid request
after all of that. A separate in-process test kills the engine thread and checks that
requests fail with 500 and /health with 503 instead of hanging.
"""

from __future__ import annotations

import copy
import os
import re
from types import SimpleNamespace

import httpx
import pytest
from fastapi.testclient import TestClient

from tests.entrypoints._server import RemoteServer
from tests.tiny_checkpoints import build_tiny_checkpoint, tiny_tokenizer
from tokenwise.engine.stats import EngineStats
from tokenwise.entrypoints.openai.api_server import build_app
from tokenwise.entrypoints.openai.async_engine import AsyncEngine
from tokenwise.entrypoints.openai.metrics import ServerMetrics
from tokenwise.entrypoints.openai.server_config import ServerConfig

KEY = "test-secret-key"
NAME = "tiny"
MAX_MODEL_LEN = 64
BODY_LIMIT = 4096
CAPS = ("--max-n", "4", "--max-logprobs", "5", "--max-tokens-cap", "32", "--max-prompts", "3")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    model_dir = build_tiny_checkpoint(tmp_path_factory.mktemp("server-errors"))
    os.remove(os.path.join(model_dir, "chat_template.jinja"))  # a tokenizer with no template
    args = ("--api-key", KEY, "--served-model-name", NAME, "--max-model-len", str(MAX_MODEL_LEN))
    args += ("--max-request-body-bytes", str(BODY_LIMIT), "--strict-request-fields", *CAPS)
    with RemoteServer(model_dir, *args) as srv:
        yield srv


def post(server: RemoteServer, path: str, body=None, key: str | None = KEY, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    headers.update(kw.pop("headers", {}))
    return httpx.post(server.url(path), json=body, headers=headers, timeout=30.0, **kw)


def error_of(response: httpx.Response, status: int, param=..., code=...) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if param is not ...:
        assert error["param"] == param, error
    if code is not ...:
        assert error["code"] == code, error
    return error


COMPLETION = {"model": NAME, "prompt": "Hello", "max_tokens": 4}
CHAT = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


@pytest.mark.parametrize(
    ("path", "override", "param"),
    [
        ("/v1/completions", {"temperature": -1}, "temperature"),
        ("/v1/completions", {"temperature": "hot"}, "temperature"),
        ("/v1/completions", {"top_p": 1.5}, "top_p"),
        ("/v1/completions", {"top_k": -2}, "top_k"),
        ("/v1/completions", {"presence_penalty": 3}, "presence_penalty"),
        ("/v1/completions", {"n": 5}, "n"),  # over --max-n 4
        ("/v1/completions", {"n": 0}, "n"),
        ("/v1/completions", {"logprobs": 6}, "logprobs"),  # over --max-logprobs 5
        ("/v1/completions", {"max_tokens": 33}, "max_tokens"),  # over --max-tokens-cap 32
        ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"max_tokens": "ten"}, "max_tokens"),
        ("/v1/completions", {"max_tokens": 4.5}, "max_tokens"),
        ("/v1/completions", {"min_tokens": 9}, "min_tokens"),  # > max_tokens 4
        ("/v1/completions", {"stream": "yes"}, "stream"),
        ("/v1/completions", {"stop_token_ids": [-1]}, "stop_token_ids"),
        ("/v1/completions", {"stop_token_ids": [10**6]}, "stop_token_ids"),  # beyond the vocab
        ("/v1/completions", {"seed": 2**64}, "seed"),  # beyond torch's generator seeds
        ("/v1/chat/completions", {"n": 2, "seed": 2**64 - 1}, "seed"),  # sample 1: seed + 1
        ("/v1/completions", {"max_token": 5}, "max_token"),  # unknown field: a typo
        (
            "/v1/chat/completions",
            {"stream_options": {"include_usage": True, "x": 1}},
            "stream_options",
        ),
        ("/v1/chat/completions", {"echo": True}, "echo"),  # known, not implemented for chat
        ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
        ("/v1/completions", {"logit_bias": {"five": 1.0}}, "logit_bias"),
        ("/v1/completions", {"logit_bias": {"1000000": 1.0}}, "logit_bias"),  # > vocab
        ("/v1/completions", {"allowed_token_ids": []}, "allowed_token_ids"),
        ("/v1/completions", {"allowed_token_ids": [10**6]}, "allowed_token_ids"),
        ("/v1/chat/completions", {"bad_words": [""]}, "bad_words"),
        ("/v1/completions", {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ("/v1/completions", {"prompt_logprobs": -1}, "prompt_logprobs"),
        ("/v1/completions", {"prompt_logprobs": 6}, "prompt_logprobs"),  # over --max-logprobs
        ("/v1/completions", {"echo": True, "logprobs": 6}, "logprobs"),
        ("/v1/chat/completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ("/v1/completions", {"best_of": 2}, "best_of"),  # no best-of-n (n is 1)
        ("/v1/completions", {"prompt": 123}, "prompt"),
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/completions", {"prompt": [10**6]}, "prompt"),  # token id out of range
        ("/v1/completions", {"prompt": ["a", "b", "c", "d"]}, "prompt"),  # over --max-prompts
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 6}, "top_logprobs"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs
        ("/v1/chat/completions", {"max_completion_tokens": 40}, "max_completion_tokens"),
    ],
)
def test_invalid_parameters_are_400(server: RemoteServer, path: str, override, param) -> None:
    base = COMPLETION if path == "/v1/completions" else CHAT
    error = error_of(post(server, path, {**base, **override}), 400, param=param)
    assert error["type"] == "invalid_request_error"


def test_prompt_longer_than_max_model_len(server: RemoteServer) -> None:
    error = error_of(post(server, "/v1/completions", {**COMPLETION, "prompt": [5] * 100}), 400)
    assert "100" in error["message"] and str(MAX_MODEL_LEN) in error["message"]
    text = {**COMPLETION, "prompt": "The quick brown fox. " * 40}
    error = error_of(post(server, "/v1/completions", text), 400, param="prompt")
    length = int(re.search(r"prompt has (\d+) tokens", error["message"]).group(1))
    assert length > MAX_MODEL_LEN and str(MAX_MODEL_LEN) in error["message"]


def test_unknown_model_is_404(server: RemoteServer) -> None:
    response = post(server, "/v1/completions", {**COMPLETION, "model": "gpt-4"})
    error_of(response, 404, param="model", code="model_not_found")
    error_of(post(server, "/v1/chat/completions", {**CHAT, "model": "x"}), 404, param="model")


def test_auth(server: RemoteServer) -> None:
    error_of(post(server, "/v1/completions", COMPLETION, key=None), 401, code="invalid_api_key")
    error_of(post(server, "/v1/completions", COMPLETION, key="wrong"), 401)
    error_of(post(server, "/v1/completions", COMPLETION, key=KEY + "x"), 401)
    basic = {"Authorization": f"Basic {KEY}"}
    error_of(post(server, "/v1/completions", COMPLETION, key=None, headers=basic), 401)
    error_of(httpx.get(server.url("/v1/models"), timeout=10.0), 401)
    ok = httpx.get(server.url("/v1/models"), headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200 and ok.json()["data"][0]["id"] == NAME
    assert httpx.get(server.url("/health"), timeout=10.0).status_code == 200
    metrics = httpx.get(server.url("/metrics"), timeout=10.0)
    assert metrics.status_code == 200 and "tokenwise:num_requests_running" in metrics.text


def test_malformed_bodies_are_400(server: RemoteServer) -> None:
    json_headers = {"Content-Type": "application/json"}
    bad = post(server, "/v1/completions", content=b'{"prompt": "x",', headers=json_headers)
    error_of(bad, 400, code="json_invalid")
    error_of(post(server, "/v1/completions", content=b"[1, 2]", headers=json_headers), 400)
    error_of(post(server, "/v1/completions", content=b"\xff\xfe", headers=json_headers), 400)
    error_of(post(server, "/v1/completions", {"model": NAME}), 400, param="prompt")


def test_body_too_large_is_413(server: RemoteServer) -> None:
    big = {**COMPLETION, "prompt": "x" * (2 * BODY_LIMIT)}
    error_of(post(server, "/v1/completions", big), 413, code="request_too_large")
    # Without Content-Length (chunked), the limit applies to the bytes actually read.
    chunks = (b'{"prompt": "' + b"x" * 1024 for _ in range(8))
    headers = {"Content-Type": "application/json"}
    chunked = post(server, "/v1/completions", content=chunks, headers=headers)
    error_of(chunked, 413, code="request_too_large")


def test_chat_without_template_is_400(server: RemoteServer) -> None:
    error_of(post(server, "/v1/chat/completions", CHAT), 400, code="no_chat_template")


def test_unknown_route_has_error_body(server: RemoteServer) -> None:
    error_of(post(server, "/v1/no-such-endpoint", {"input": "x"}), 404)


def test_still_serves_after_errors(server: RemoteServer) -> None:
    response = post(server, "/v1/completions", COMPLETION)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] <= 4
    assert httpx.get(server.url("/health"), timeout=10.0).status_code == 200


class _BuggyEngine:
    """Enough of LLMEngine for AsyncEngine; its first step raises, as a bug would."""

    def __init__(self, tokenizer=None) -> None:
        self.tokenizer = tokenizer
        self.model_config = SimpleNamespace(max_model_len=MAX_MODEL_LEN)
        self.requests: list[str] = []

    def get_stats(self) -> EngineStats:
        return EngineStats()

    def check_health(self) -> None:  # alive as long as the test wants it
        pass

    def wakeup(self) -> None:  # step() never waits
        pass

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def add_request(self, request_id: str, prompt, params) -> None:
        self.requests.append(request_id)

    def abort_request(self, request_ids) -> None:
        pass

    def step(self):
        raise RuntimeError("simulated engine bug")


def in_process_app(tokenizer=None, engine=None):
    """An app around `engine` (default: one whose first step raises), without a subprocess."""
    config = ServerConfig(served_model_name=NAME, max_model_len=MAX_MODEL_LEN)
    metrics = ServerMetrics(NAME)
    inner = engine if engine is not None else _BuggyEngine(tokenizer)
    engine = AsyncEngine(inner, observer=metrics.observe)  # type: ignore[arg-type]
    metrics.attach_engine(lambda: engine.stats)
    return build_app(engine, config, metrics)


@pytest.mark.timeout(60)
def test_chat_template_error_is_400() -> None:
    tokenizer = copy.deepcopy(tiny_tokenizer())
    tokenizer.chat_template = "{{ raise_exception('only one message, please') }}"
    with TestClient(in_process_app(tokenizer)) as client:
        response = client.post("/v1/chat/completions", json=CHAT)
        error = error_of(response, 400, param="messages")
        assert "only one message, please" in error["message"]
        assert client.get("/openapi.json").status_code == 200


@pytest.mark.timeout(60)
def test_chat_text_that_is_not_unicode_is_400() -> None:
    """JSON may escape a lone UTF-16 surrogate; the tokenizer's TypeError on the rendered chat
    was a 500. The reply names the character escaped, so the body itself stays valid UTF-8."""
    json_headers = {"Content-Type": "application/json"}
    with TestClient(in_process_app(tiny_tokenizer())) as client:
        for message in (
            rb'{"role": "user", "content": "hi \ud800"}',
            rb'{"role": "\udc00", "content": "hi"}',
            rb'{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}',
        ):
            body = b'{"max_tokens": 4, "messages": [' + message + b"]}"
            response = client.post("/v1/chat/completions", content=body, headers=json_headers)
            error = error_of(response, 400, param="messages")
            assert "lone surrogate '\\u" in error["message"], error


@pytest.mark.timeout(60)
def test_dead_engine_fails_requests_and_health() -> None:
    with TestClient(in_process_app()) as client:
        body = {"prompt": [1, 2, 3], "max_tokens": 4}
        # In flight when the engine dies: answered with 503, not left hanging.
        error_of(client.post("/v1/completions", json=body), 503, code="engine_dead")
        assert client.get("/health").status_code == 503
        # Later requests are refused at once, streamed or not.
        error_of(client.post("/v1/completions", json=body), 503, code="engine_dead")
        error_of(client.post("/v1/completions", json={**body, "stream": True}), 503)
