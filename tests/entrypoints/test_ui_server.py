"""The web page's server side over real HTTP: the step records of a known workload arrive
whole through the engine-core process (every prompt and decode token accounted for), the ring
stays bounded when more steps run than it holds, the SSE stream carries the same records, the
data routes need the API key while the page itself loads without it, and --disable-ui removes
the page."""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import httpx
import pytest
from fastapi.testclient import TestClient

from tests.entrypoints._server import RemoteServer
from tests.tiny_checkpoints import build_tiny_checkpoint
from tokenwise.engine.step_records import ENV_CAPACITY
from tokenwise.entrypoints.openai.api_server import build_app
from tokenwise.entrypoints.openai.cli_args import add_server_args, server_config_kwargs
from tokenwise.entrypoints.openai.metrics import ServerMetrics
from tokenwise.entrypoints.openai.server_config import ServerConfig

KEY = "ui-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CAPACITY = 40
PROMPTS = ["Hello world", "The quick brown fox jumps over", "def f(x):"]
MAX_TOKENS = 7


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("ui-server"))


@pytest.fixture(scope="module")
def server(model_dir: str):
    env = {ENV_CAPACITY: str(CAPACITY)}
    with RemoteServer(model_dir, "--api-key", KEY, env=env) as srv:
        yield srv


def steps(server: RemoteServer, since: int) -> dict:
    response = httpx.get(server.url("/ui/api/steps"), params={"since": since}, headers=AUTH)
    assert response.status_code == 200, response.text
    return response.json()


def complete(server: RemoteServer, prompt: str, max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    response = httpx.post(server.url("/v1/completions"), json=body, headers=AUTH, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["usage"]


def test_step_records_sum_to_the_workload_and_stay_bounded(server: RemoteServer) -> None:
    start = steps(server, 0)["next"]
    usages = [complete(server, prompt, MAX_TOKENS) for prompt in PROMPTS]
    reply = steps(server, start)
    records = reply["records"]
    assert reply["missed"] == 0 and reply["capacity"] == CAPACITY
    assert reply["next"] == start + len(records)
    # Each prompt is prefilled once (the prompts share no full KV block, so no prefix hit);
    # each request feeds back every sampled token but its last in decode steps.
    assert sum(r["prefill_tokens"] for r in records) == sum(u["prompt_tokens"] for u in usages)
    assert all(u["completion_tokens"] == MAX_TOKENS for u in usages)
    assert sum(r["decode_tokens"] for r in records) == len(PROMPTS) * (MAX_TOKENS - 1)
    assert sum(r["finished"] for r in records) == len(PROMPTS)
    assert records[-1]["num_running"] == 0 and records[-1]["kv_used"] == 0
    assert {r["rank"] for r in records} == {0} and all(r["forward_ms"] > 0 for r in records)

    # More steps than the ring holds: it keeps the last CAPACITY, and a reader from the start
    # is told how many it missed.
    complete(server, "Hello", 2 * CAPACITY)
    reply = steps(server, 0)
    assert len(reply["records"]) == CAPACITY
    assert reply["missed"] == reply["next"] - CAPACITY > 0
    last = reply["records"][-1]
    assert last["finished"] == 1 and last["decode_tokens"] == 1

    snapshot = httpx.get(server.url("/ui/api/engine"), headers=AUTH).json()
    rank = snapshot["ranks"][0]
    assert len(rank["kv_blocks"]) == rank["num_total_blocks"] > 0
    assert set(rank["kv_blocks"]) <= {"0", "1"}  # nothing in use once idle
    assert rank["finished_reasons"]["length"] == len(PROMPTS) + 1
    assert any(size == 1 for size, _, _ in snapshot["forward_times"])  # decode passes timed


def test_stream_sends_the_records_of_a_request_as_events(server: RemoteServer) -> None:
    start = steps(server, 0)["next"]
    usage = complete(server, "The cat sat", 5)
    url = server.url("/ui/api/steps/stream")
    got = []
    with httpx.stream("GET", url, params={"since": start}, headers=AUTH, timeout=30) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                got.extend(json.loads(line[6:])["records"])
            if sum(r["finished"] for r in got):
                break
    assert sum(r["prefill_tokens"] for r in got) == usage["prompt_tokens"]
    assert sum(r["decode_tokens"] for r in got) == 4


def test_page_is_open_and_data_needs_the_key(server: RemoteServer) -> None:
    page = httpx.get(server.url("/"))
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script src="/ui/app.js"></script>' in page.text
    for name, marker in (("app.js", "streamGeneration"), ("engine.js", "followSteps")):
        asset = httpx.get(server.url(f"/ui/{name}"))
        assert asset.status_code == 200 and marker in asset.text
        assert asset.headers["content-type"].startswith("text/javascript")
    assert httpx.get(server.url("/ui/secrets.txt")).status_code == 404
    for path in ("/ui/api/steps", "/ui/api/engine", "/ui/api/steps/stream"):
        refused = httpx.get(server.url(path), headers={"Authorization": "Bearer wrong"})
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    bad = httpx.get(server.url("/ui/api/steps"), params={"since": -1}, headers=AUTH)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "since"


def test_disable_ui_removes_the_page() -> None:
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    for flags, page_status in (([], 200), (["--disable-ui"], 404)):
        config = ServerConfig("m", 64, **server_config_kwargs(parser.parse_args(flags)))
        # The routes only: no engine runs (the lifespan, which would start it, is not entered).
        app = build_app(SimpleNamespace(engine=None), config, ServerMetrics("m"))
        client = TestClient(app)
        assert client.get("/").status_code == page_status
        assert client.get("/ui/app.js").status_code == page_status
