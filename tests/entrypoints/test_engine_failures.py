"""What clients see when the engine fails, and what the process does about it.

The promise (README, "Reliability"): a forward pass that raises (a model error, out of memory)
fails only the requests of that step, each with an OpenAI-style error (a 500 body, or an error
event and a closed stream), and the engine serves on; blocks that step wrote are dropped from
the prefix cache, so no later request reuses half-written K/V. Three failed steps in a row, or
any bug that kills the engine loop, end the engine: every waiting client gets an error,
`/health` answers 503, and `tokenwise serve` exits with status 1 and a log line saying why.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from tests.engine._fixtures import assert_pool_clean, checkpoint, hf_greedy
from tests.entrypoints._faulty_serve import PLANTED
from tests.entrypoints._server import RemoteServer
from tests.entrypoints.test_server_errors import MAX_MODEL_LEN, error_of, in_process_app
from tokenwise import LLM, SamplingParams
from tokenwise.engine.llm_engine import MAX_CONSECUTIVE_FAILED_STEPS, LLMEngine

PROMPT = torch.randint(3, 250, (40,), generator=torch.Generator().manual_seed(11)).tolist()


class FlakyRunner:
    """Wraps a runner's `execute_model`; `arm(k)` makes the next k calls raise, as an out of
    memory would, after the step's blocks were allocated and registered."""

    def __init__(self, engine: LLMEngine) -> None:
        self._execute = engine.runner.execute_model
        self.failures_left = 0
        engine.runner.execute_model = self  # type: ignore[method-assign]

    def arm(self, failures: int = 1) -> None:
        self.failures_left = failures

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.failures_left:
            self.failures_left -= 1
            raise torch.OutOfMemoryError("injected: out of memory")
        return self._execute(*args, **kwargs)


@pytest.fixture
def engine() -> LLMEngine:
    llm = LLM(checkpoint(), dtype="float32", num_gpu_blocks=32, max_model_len=MAX_MODEL_LEN)
    return llm.llm_engine


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run_to_end(engine: LLMEngine, limit: int = 500) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            return merged
        for out in engine.step():
            if out.request_id in merged:
                merged[out.request_id].merge(out)
            else:
                merged[out.request_id] = out
    raise AssertionError(f"requests still unfinished after {limit} steps")


def test_failed_step_fails_its_requests_and_leaves_no_poisoned_cache(
    engine: LLMEngine,
) -> None:
    flaky = FlakyRunner(engine)
    flaky.arm()
    engine.add_request("first", PROMPT, greedy(4))
    [out] = engine.step()
    assert out.finished and out.outputs[0].finish_reason == "error"
    assert "OutOfMemoryError" in out.error
    assert_pool_clean(engine)
    # The same prompt again: its full blocks were registered before the pass failed. A hit on
    # them would read K/V that was never written and change the greedy tokens.
    engine.add_request("again", PROMPT, greedy(4))
    again = run_to_end(engine)["again"]
    assert again.error is None and again.num_cached_tokens == 0
    assert again.outputs[0].token_ids == hf_greedy(checkpoint(), PROMPT, 4)
    assert_pool_clean(engine)


def test_repeated_failures_give_up_with_a_clear_error(engine: LLMEngine) -> None:
    flaky = FlakyRunner(engine)
    flaky.arm(MAX_CONSECUTIVE_FAILED_STEPS)
    for i in range(MAX_CONSECUTIVE_FAILED_STEPS - 1):
        engine.add_request(f"r{i}", PROMPT, greedy(2))
        [out] = engine.step()  # fails this request only; the engine carries on
        assert out.outputs[0].finish_reason == "error"
    engine.add_request("last", PROMPT, greedy(2))
    with pytest.raises(RuntimeError, match=f"{MAX_CONSECUTIVE_FAILED_STEPS} forward passes"):
        engine.step()


def sse_events(lines: Iterator[str]) -> list[Any]:
    return [
        line[len("data: ") :] if line == "data: [DONE]" else json.loads(line[len("data: ") :])
        for line in lines
        if line.startswith("data: ")
    ]


@pytest.mark.timeout(120)
def test_server_answers_failed_steps_with_errors_and_recovers(engine: LLMEngine) -> None:
    flaky = FlakyRunner(engine)
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    with TestClient(in_process_app(engine=engine)) as client:
        flaky.arm()
        error = error_of(client.post("/v1/completions", json=body), 500, code="generation_error")
        assert "out of memory" in error["message"]
        flaky.arm()
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
            assert resp.status_code == 200
            events = sse_events(resp.iter_lines())
        assert events[-1] == "[DONE]" and "out of memory" in events[-2]["error"]["message"]
        assert [e for e in events[:-2] if "error" in e] == []
        assert client.get("/health").status_code == 200  # recovered, not degraded
        ok = client.post("/v1/completions", json=body)
        assert ok.status_code == 200, ok.text
        assert ok.json()["choices"][0]["finish_reason"] == "length"
        # Finished requests free their blocks before their last output is published.
        bm = engine.block_manager
        assert bm.get_num_free_blocks() == bm.num_blocks


@pytest.mark.timeout(240)
def test_server_exits_nonzero_when_its_engine_loop_dies(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    from tests.tiny_checkpoints import build_tiny_checkpoint

    model_dir = build_tiny_checkpoint(tmp_path_factory.mktemp("faulty"))
    with RemoteServer(model_dir, launcher=("-m", "tests.entrypoints._faulty_serve")) as server:
        body = {"prompt": "Hello", "max_tokens": 4}
        response = httpx.post(server.url("/v1/completions"), json=body, timeout=30.0)
        error_of(response, 503, code="engine_dead")
        assert server.proc.wait(timeout=60) == 1
        # The bug killed the engine-core process; the server names it and the bug.
        log = server.log()
        assert "tokenwise: error: the engine loop died (RuntimeError: the engine core" in log
        assert f"RuntimeError: {PLANTED}; the engine cannot continue" in log
