"""An in-process app around a stand-in engine that records the prompts it is given and answers
every request with fixed text, one piece per step, so tests can check exactly which token ids
reach the engine and how a known reply is presented, without a model."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from fastapi.testclient import TestClient

from tokenwise.engine.stats import EngineStats
from tokenwise.entrypoints.openai.api_server import build_app
from tokenwise.entrypoints.openai.async_engine import AsyncEngine
from tokenwise.entrypoints.openai.metrics import ServerMetrics
from tokenwise.entrypoints.openai.server_config import ServerConfig
from tokenwise.outputs import CompletionOutput, RequestOutput

NAME = "recorded"


class RecordingEngine:
    """Enough of LLMEngine for AsyncEngine: records each prompt (and its sampling parameters),
    then answers it with `pieces` (one per step, one token each), finishing with
    `finish_reason` ("length": as if cut off by max_tokens)."""

    def __init__(self, tokenizer: Any, pieces: list[str], finish_reason: str = "stop") -> None:
        self.tokenizer = tokenizer
        self.model_config = SimpleNamespace(max_model_len=256)
        self.prompts: list = []
        self.params: list = []
        self._pieces = pieces
        self._finish_reason = finish_reason
        self._progress: dict[str, int] = {}  # request id -> pieces sent

    def get_stats(self) -> EngineStats:
        return EngineStats()

    def check_health(self) -> None:
        pass

    def wakeup(self) -> None:
        pass

    def has_unfinished_requests(self) -> bool:
        return bool(self._progress)

    def add_request(self, request_id: str, prompt, params) -> None:
        self.prompts.append(prompt)
        self.params.append(params)
        self._progress[request_id] = 0

    def abort_request(self, request_ids) -> None:
        for rid in request_ids:
            self._progress.pop(rid, None)

    def step(self) -> list[RequestOutput]:
        outputs = []
        for rid, sent in list(self._progress.items()):
            last = sent + 1 == len(self._pieces)
            piece = CompletionOutput(
                0,
                self._pieces[sent],
                [7 + sent],
                finish_reason=self._finish_reason if last else None,
            )
            outputs.append(RequestOutput(rid, None, [1, 2, 3], [piece], finished=last))
            if last:
                del self._progress[rid]
            else:
                self._progress[rid] = sent + 1
        return outputs


def app_for(
    tokenizer: Any, pieces: list[str] | None = None, finish_reason: str = "stop", **config: Any
) -> tuple[TestClient, RecordingEngine]:
    """A test client of the app (use it as a context manager) and the engine behind it;
    `config`: ServerConfig fields (a reasoning parser, say)."""
    inner = RecordingEngine(tokenizer, pieces or ["total = a + b"], finish_reason)
    server_config = ServerConfig(served_model_name=NAME, max_model_len=256, **config)
    metrics = ServerMetrics(NAME)
    engine = AsyncEngine(inner, observer=metrics.observe)  # type: ignore[arg-type]
    metrics.attach_engine(lambda: engine.stats)
    return TestClient(build_app(engine, server_config, metrics)), inner
