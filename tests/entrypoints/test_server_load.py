"""A bounded load test: many concurrent streams, some of them abandoned, on one server.

What must hold under load: every stream that is read to the end gets exactly `max_tokens`
tokens (counted from the per-chunk logprobs, and from the usage chunk) and `[DONE]`; streams
that are closed early are aborted on the server (the abort counter moves), and once
everything settles no request is running and no KV block is in use.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.entrypoints._server import RemoteServer, metric_value, wait_for_idle
from tests.tiny_checkpoints import build_tiny_checkpoint

NAME = "tiny"
NUM_CLIENTS = 64
MAX_TOKENS = 16
OVERALL_TIMEOUT_S = 90.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    model_dir = build_tiny_checkpoint(tmp_path_factory.mktemp("server-load"))
    with RemoteServer(model_dir, "--served-model-name", NAME) as srv:
        yield srv


async def stream_one(client: httpx.AsyncClient, index: int, abandon: bool) -> dict:
    body = {
        "model": NAME,
        "prompt": f"Request {index}: the quick brown fox",
        "max_tokens": MAX_TOKENS,
        "temperature": 0.8,
        "seed": index,
        "ignore_eos": True,
        "logprobs": 0,  # one logprob per token: lets the client count tokens exactly
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = {"tokens": 0, "done": False, "usage": None, "finish": None}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                result["done"] = True
                break
            chunk = json.loads(line[len("data: ") :])
            if abandon:
                break  # leaving the block closes the connection mid-stream
            if chunk["choices"]:
                choice = chunk["choices"][0]
                result["tokens"] += len(choice["logprobs"]["tokens"])
                result["finish"] = choice["finish_reason"] or result["finish"]
            else:
                result["usage"] = chunk["usage"]
    return result


async def run_clients(base_url: str) -> list[dict]:
    limits = httpx.Limits(max_connections=NUM_CLIENTS + 8)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=60.0) as client:
        tasks = [stream_one(client, i, abandon=i % 3 == 0) for i in range(NUM_CLIENTS)]
        return await asyncio.wait_for(asyncio.gather(*tasks), OVERALL_TIMEOUT_S)


def test_concurrent_streams_with_disconnects(server: RemoteServer) -> None:
    before = server.metrics()
    results = asyncio.run(run_clients(server.base_url))
    abandoned = [r for i, r in enumerate(results) if i % 3 == 0]
    completed = [r for i, r in enumerate(results) if i % 3 != 0]
    for r in completed:
        assert r["done"] and r["finish"] == "length"
        assert r["tokens"] == MAX_TOKENS
        assert r["usage"]["completion_tokens"] == MAX_TOKENS
    assert not any(r["done"] for r in abandoned)
    assert httpx.get(server.url("/health"), timeout=10.0).status_code == 200

    after = wait_for_idle(server)

    def delta(name: str, **labels: str) -> float:
        return metric_value(after, name, **labels) - metric_value(before, name, **labels)

    assert delta("tokenwise:request_success_total", finished_reason="length") >= len(completed)
    # Abandoned streams were aborted rather than generated to the end.
    aborted = delta("tokenwise:request_success_total", finished_reason="abort")
    assert len(abandoned) / 2 <= aborted <= len(abandoned)
    generated = delta("tokenwise:generation_tokens_total")
    assert generated < NUM_CLIENTS * MAX_TOKENS


def test_non_streaming_client_disconnect_aborts(server: RemoteServer) -> None:
    body = {"model": NAME, "prompt": "Hi", "max_tokens": 490, "ignore_eos": True}
    # The client gives up after a third of what the whole answer takes on this machine now
    # (a fixed timeout raced the generation on a fast machine).
    started = time.monotonic()
    assert httpx.post(server.url("/v1/completions"), json=body, timeout=60).status_code == 200
    give_up_after = (time.monotonic() - started) / 3
    before = wait_for_idle(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url("/v1/completions"), json=body, timeout=give_up_after)
    after = wait_for_idle(server)

    def delta(name: str, **labels: str) -> float:
        return metric_value(after, name, **labels) - metric_value(before, name, **labels)

    assert delta("tokenwise:request_success_total", finished_reason="abort") == 1
    assert delta("tokenwise:generation_tokens_total") < 490
