"""A bounded load test: many concurrent streams, some of them abandoned, on one server.

What must hold under load: every stream that is read to the end gets exactly `max_tokens`
tokens (counted from the per-chunk logprobs, and from the usage chunk) and `[DONE]`; streams
that are closed early are aborted on the server (the abort counter moves by exactly their
number), and once everything settles no request is running and no KV block is in use.

The server runs with a planted per-step delay (`_slow_step_serve`): an abandoned request asks
for so many tokens that it cannot finish before its disconnect reaches the engine, whatever
the machine's load, so the counts are exact rather than raced.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.entrypoints._server import RemoteServer, metric_value, wait_for_idle
from tests.tiny_checkpoints import build_tiny_checkpoint

NAME = "tiny"
NUM_CLIENTS = 64
MAX_TOKENS = 16
# An abandoned stream asks for this many: at STEP_DELAY_S a step, it could finish only after
# 40 s, longer than `wait_for_idle` waits, so only an abort lets the server go idle in time.
ABANDONED_MAX_TOKENS = 400
OVERALL_TIMEOUT_S = 90.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    model_dir = build_tiny_checkpoint(tmp_path_factory.mktemp("server-load"))
    launcher = ("-m", "tests.entrypoints._slow_step_serve")
    with RemoteServer(model_dir, "--served-model-name", NAME, launcher=launcher) as srv:
        yield srv


async def stream_one(client: httpx.AsyncClient, index: int, abandon: bool) -> dict:
    body = {
        "model": NAME,
        "prompt": f"Request {index}: the quick brown fox",
        "max_tokens": ABANDONED_MAX_TOKENS if abandon else MAX_TOKENS,
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

    assert delta("tokenwise:request_success_total", finished_reason="length") == len(completed)
    # Every abandoned stream was aborted rather than generated to the end.
    assert delta("tokenwise:request_success_total", finished_reason="abort") == len(abandoned)
    generated = delta("tokenwise:generation_tokens_total")
    assert generated < len(completed) * MAX_TOKENS + len(abandoned) * ABANDONED_MAX_TOKENS


def test_non_streaming_client_disconnect_aborts(server: RemoteServer) -> None:
    body = {"model": NAME, "prompt": "Hi", "max_tokens": 490, "ignore_eos": True}
    # 490 steps take at least 49 s (STEP_DELAY_S each): the request is certainly still running
    # when the client gives up after 3 s, and can end within `wait_for_idle` only by an abort.
    before = wait_for_idle(server)
    with pytest.raises(httpx.ReadTimeout, match="timed out"):
        httpx.post(server.url("/v1/completions"), json=body, timeout=3.0)
    after = wait_for_idle(server)

    def delta(name: str, **labels: str) -> float:
        return metric_value(after, name, **labels) - metric_value(before, name, **labels)

    assert delta("tokenwise:request_success_total", finished_reason="abort") == 1
    assert delta("tokenwise:generation_tokens_total") < 490
