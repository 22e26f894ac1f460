"""`AsyncCoreEngine`: outputs read by the event loop from the client's descriptor, the waiting
bound counted over requests without outputs, and a dead core failing everyone at once.

A fake core client stands in for `EngineCoreClient`: its descriptor is a pipe the test writes
to when it "sends" outputs, so what arrives, and when, is exactly known (no timing). The real
client runs under every server test (`tokenwise serve` uses this front end by default).
"""

from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace

import pytest

from tokenwise.engine.stats import EngineStats
from tokenwise.entrypoints.openai.async_core_engine import AsyncCoreEngine
from tokenwise.entrypoints.openai.errors import EngineDeadError, ServerOverloadedError
from tokenwise.outputs import RequestOutput
from tokenwise.sampling.params import SamplingParams

PARAMS = SamplingParams(max_tokens=4)


class _FakeCores:
    def __init__(self) -> None:
        self.model_config = SimpleNamespace(max_model_len=64)
        self.tokenizer = None
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        self.pending: list[RequestOutput] = []
        self.added: list[str] = []
        self.aborted: list[str] = []
        self.failure: BaseException | None = None

    @property
    def output_fd(self) -> int:
        return self._read

    def add_request(self, request_id: str, prompt: object, params: object) -> None:
        if prompt == "bad":
            raise ValueError("prompt: bad input")
        self.added.append(request_id)

    def abort_request(self, request_ids: list[str]) -> None:
        self.aborted.extend(request_ids)

    def send(self, *outputs: RequestOutput) -> None:
        """What a core does: queue outputs and make the descriptor readable."""
        self.pending.extend(outputs)
        os.write(self._write, b"x")

    def drain(self) -> list[RequestOutput]:
        try:
            os.read(self._read, 4096)
        except BlockingIOError:
            pass
        self.check_health()
        out, self.pending = self.pending, []
        return out

    def check_health(self) -> None:
        if self.failure is not None:
            raise self.failure

    def get_stats(self) -> EngineStats:
        return EngineStats()

    def wakeup(self) -> None:
        pass


def _out(rid: str, finished: bool = False) -> RequestOutput:
    return RequestOutput(rid, None, [1], [], finished=finished)


async def _next(stream: object) -> tuple[int, RequestOutput]:
    return await asyncio.wait_for(stream.__anext__(), 5)  # type: ignore[attr-defined]


def test_outputs_bound_and_death() -> None:
    async def scenario() -> None:
        cores = _FakeCores()
        deaths: list[BaseException] = []
        engine = AsyncCoreEngine(cores, on_dead=deaths.append, max_waiting_requests=2)  # type: ignore[arg-type]
        engine.start()
        assert engine.is_healthy
        first = await engine.submit("a", ["p"], PARAMS)
        with pytest.raises(ValueError, match="prompt: bad input"):  # refused: not waiting
            await engine.submit("d", ["bad"], PARAMS)
        second = await engine.submit("b", ["p"], PARAMS)
        assert cores.added == ["a-0", "b-0"]  # handed to the cores by the handler itself
        # Both wait (no output yet): a third is over the bound.
        with pytest.raises(ServerOverloadedError, match="2 requests wait"):
            await engine.submit("c", ["p"], PARAMS)
        cores.send(_out("a-0"))
        index, output = await _next(first)
        assert (index, output.request_id) == (0, "a-0")
        # "a" is generating now: one waits, so one more fits.
        third = await engine.submit("c", ["p"], PARAMS)
        cores.send(_out("a-0", finished=True), _out("c-0", finished=True))
        assert (await _next(first))[1].finished
        assert (await _next(third))[1].finished
        second.close()
        assert cores.aborted[-1] == "b-0"  # (the refused "d-0" was aborted too: a no-op)
        # A core dies: the next read fails every waiting stream, and the server is told.
        waiting = await engine.submit("e", ["p"], PARAMS)
        cores.failure = RuntimeError("the engine core (pid 1) exited with code -9")
        cores.send()
        with pytest.raises(RuntimeError, match="exited with code -9"):
            await _next(waiting)
        assert len(deaths) == 1 and not engine.is_healthy
        with pytest.raises(EngineDeadError, match="exited with code -9"):
            await engine.submit("f", ["p"], PARAMS)
        engine.shutdown()

    asyncio.run(scenario())


def test_an_idle_dead_core_is_noticed(monkeypatch: pytest.MonkeyPatch) -> None:
    from tokenwise.entrypoints.openai import async_core_engine

    monkeypatch.setattr(async_core_engine, "HEALTH_CHECK_INTERVAL_S", 0.01)

    async def scenario() -> None:
        cores = _FakeCores()
        deaths: list[BaseException] = []
        engine = AsyncCoreEngine(cores, on_dead=deaths.append)  # type: ignore[arg-type]
        engine.start()
        cores.failure = RuntimeError("gone")  # nothing is sent: only the health check sees it
        for _ in range(200):
            if deaths:
                break
            await asyncio.sleep(0.01)
        assert [str(d) for d in deaths] == ["gone"] and not engine.is_healthy
        engine.shutdown()

    asyncio.run(scenario())


def test_a_request_after_an_unnoticed_death_is_a_dead_engine_not_a_bad_request() -> None:
    async def scenario() -> None:
        cores = _FakeCores()
        deaths: list[BaseException] = []
        engine = AsyncCoreEngine(cores, on_dead=deaths.append)  # type: ignore[arg-type]
        engine.start()
        cores.failure = RuntimeError("the engine core (pid 1) exited with code -9")
        with pytest.raises(EngineDeadError, match="exited with code -9"):
            await engine.submit("a", ["p"], PARAMS)
        assert cores.added == [] and len(deaths) == 1 and not engine.is_healthy
        engine.shutdown()

    asyncio.run(scenario())
