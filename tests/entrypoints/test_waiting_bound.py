"""`--max-waiting-requests`: a bounded waiting queue, and 503 with Retry-After beyond it.

A fake engine holds every request it is given in its waiting queue until the test schedules
them, so what waits is exactly known (no timing): the bound counts requests handed to the engine
but not yet scheduled, including a burst posted between two of its steps.
"""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from tokenwise.engine.stats import EngineStats
from tokenwise.entrypoints.openai.api_server import build_app
from tokenwise.entrypoints.openai.async_engine import AsyncEngine
from tokenwise.entrypoints.openai.errors import ServerOverloadedError
from tokenwise.entrypoints.openai.metrics import ServerMetrics
from tokenwise.entrypoints.openai.server_config import ServerConfig
from tokenwise.sampling.params import SamplingParams

PARAMS = SamplingParams(max_tokens=4)


class _QueueingEngine:
    """Enough of LLMEngine: requests wait until `schedule_all`, and never finish."""

    def __init__(self) -> None:
        self.model_config = SimpleNamespace(max_model_len=64)
        self.tokenizer = None
        self.waiting: list[str] = []
        self.running: list[str] = []
        self.steps = 0
        self._lock = threading.Lock()

    def add_request(self, request_id: str, prompt, params) -> None:
        with self._lock:
            self.waiting.append(request_id)

    def abort_request(self, request_ids) -> None:
        with self._lock:
            self.waiting = [r for r in self.waiting if r not in request_ids]
            self.running = [r for r in self.running if r not in request_ids]

    def check_health(self) -> None:  # alive as long as the test wants it
        pass

    def wakeup(self) -> None:  # step() never waits
        pass

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list:
        time.sleep(0.005)
        self.steps += 1
        return []

    def get_stats(self) -> EngineStats:
        with self._lock:
            return EngineStats(num_waiting=len(self.waiting), num_running=len(self.running))

    def schedule_all(self) -> None:
        with self._lock:
            self.running += self.waiting
            self.waiting = []


def _refreshed(engine: AsyncEngine, inner: _QueueingEngine) -> None:
    """Wait (bounded) until the engine thread has stepped and published fresh stats."""
    start = inner.steps
    deadline = time.monotonic() + 10
    while inner.steps < start + 2:
        assert time.monotonic() < deadline, "the engine loop did not step"
        time.sleep(0.005)


async def _submit(engine: AsyncEngine, rid: str, prompts: int = 1) -> None:
    await engine.submit(rid, [[1, 2, 3]] * prompts, PARAMS)


def test_requests_beyond_the_bound_are_refused_until_the_queue_drains() -> None:
    inner = _QueueingEngine()
    engine = AsyncEngine(inner, max_waiting_requests=3)  # type: ignore[arg-type]
    engine.start()
    try:
        asyncio.run(_submit(engine, "a", prompts=2))
        asyncio.run(_submit(engine, "b"))
        # Counted from the hand-over on, whether or not the engine has stepped since: 3 wait.
        with pytest.raises(
            ServerOverloadedError, match=r"3 requests wait .*max-waiting-requests=3"
        ):
            asyncio.run(_submit(engine, "c"))
        _refreshed(engine, inner)
        with pytest.raises(ServerOverloadedError, match="3 requests wait"):
            asyncio.run(_submit(engine, "d"))
        assert sorted(inner.waiting) == ["a-0", "a-1", "b-0"]  # the refused never reached it
        inner.schedule_all()  # they run now: nobody waits
        _refreshed(engine, inner)
        asyncio.run(_submit(engine, "e", prompts=3))
        with pytest.raises(ServerOverloadedError, match="3 requests wait"):
            asyncio.run(_submit(engine, "f"))
    finally:
        engine.shutdown()


def test_an_unbounded_engine_accepts_any_number() -> None:
    inner = _QueueingEngine()
    engine = AsyncEngine(inner)  # type: ignore[arg-type]
    engine.start()
    try:
        for i in range(20):
            asyncio.run(_submit(engine, f"r{i}"))
        _refreshed(engine, inner)
        assert len(inner.waiting) == 20
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match="max_waiting_requests must be >= 1, got 0"):
        AsyncEngine(inner, max_waiting_requests=0)  # type: ignore[arg-type]


@pytest.mark.timeout(60)
def test_the_server_answers_503_with_retry_after() -> None:
    inner = _QueueingEngine()
    engine = AsyncEngine(inner, max_waiting_requests=1)  # type: ignore[arg-type]
    config = ServerConfig(served_model_name="m", max_model_len=64)
    metrics = ServerMetrics("m")
    metrics.attach_engine(lambda: engine.stats)
    with TestClient(build_app(engine, config, metrics)) as client:
        asyncio.run(_submit(engine, "held"))  # the one waiting slot is taken
        for stream in (False, True):
            body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4, "stream": stream}
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 503, response.text
            assert response.headers["Retry-After"] == "1"
            error = response.json()["error"]
            assert error["code"] == "server_overloaded"
            assert "--max-waiting-requests=1" in error["message"]
        assert inner.waiting == ["held-0"]
