"""The engine core in its own process behind `EngineCoreClient`, as `tokenwise serve` runs it.

Driven here without HTTP: the same requests through a core process and through an in-process
engine give the same tokens, text, logprobs, finish reasons and prompts (the client strips
the prompts from the wire and puts them back); bad input fails in the caller; aborts free the
core's blocks; and a killed core fails the client with an error naming it, on every later call.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.engine._fixtures import LLAMA, checkpoint, mixed_prompts
from tokenwise import SamplingParams
from tokenwise.engine.client import ENV_MULTIPROCESSING, EngineClient, create_engine
from tokenwise.engine.core_client import EngineCoreClient
from tokenwise.engine.llm_engine import LLMEngine
from tokenwise.entrypoints.llm import build_engine_config
from tokenwise.outputs import RequestOutput


def _config() -> Any:
    return build_engine_config(checkpoint(LLAMA), dtype="float32", kv_cache_memory=1 << 23)


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[EngineCoreClient, LLMEngine]]:
    core = create_engine(_config(), core_process=True)
    local = create_engine(_config())
    yield core, local
    core.shutdown()
    local.shutdown()


def _run(engine: EngineClient, requests: dict[str, tuple[Any, SamplingParams]]) -> dict:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    merged: dict[str, RequestOutput] = {}
    deadline = time.monotonic() + 120
    while any(engine.has_request(rid) for rid in requests):
        assert time.monotonic() < deadline, "requests did not finish"
        for delta in engine.step():
            if delta.request_id in merged:
                merged[delta.request_id].merge(delta)
            else:
                merged[delta.request_id] = delta
    return merged


def test_serve_gets_a_core_process_and_llm_an_in_process_engine(
    engines: tuple[EngineCoreClient, LLMEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    core, local = engines
    assert isinstance(core, EngineCoreClient) and isinstance(local, LLMEngine)
    assert isinstance(core, EngineClient)
    (pid,) = core.rank_pids
    assert pid is not None and pid != os.getpid()
    os.kill(pid, 0)  # alive
    monkeypatch.setenv(ENV_MULTIPROCESSING, "0")
    kept = create_engine(_config(), core_process=True)
    try:
        assert isinstance(kept, LLMEngine)
    finally:
        kept.shutdown()
    monkeypatch.setenv(ENV_MULTIPROCESSING, "maybe")
    with pytest.raises(ValueError, match=ENV_MULTIPROCESSING):
        create_engine(_config(), core_process=True)


def test_a_core_process_answers_like_the_in_process_engine(
    engines: tuple[EngineCoreClient, LLMEngine],
) -> None:
    core, local = engines
    prompts = mixed_prompts()[:4]
    tok = local.tokenizer
    stop_text = tok.decode(prompts[0][-3:])  # something the model may or may not say
    requests = {
        "greedy": (prompts[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)),
        "logprobs": (prompts[1], SamplingParams(temperature=0, max_tokens=6, logprobs=3)),
        "seeded-n2": (prompts[2], SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=8)),
        "text": (
            "Hello there, how",
            SamplingParams(temperature=0, max_tokens=10, stop=[stop_text]),
        ),
        "min": (prompts[3], SamplingParams(temperature=0, max_tokens=3, min_tokens=3)),
    }
    got, want = _run(core, requests), _run(local, requests)
    assert set(got) == set(want) == set(requests)
    for rid in requests:
        g, w = got[rid], want[rid]
        assert g.finished and w.finished
        assert g.prompt == w.prompt and g.prompt_token_ids == w.prompt_token_ids, rid
        assert len(g.outputs) == len(w.outputs), rid
        for go, wo in zip(g.outputs, w.outputs, strict=True):
            assert go.token_ids == wo.token_ids, rid
            assert go.text == wo.text, rid
            assert (go.finish_reason, go.stop_reason) == (wo.finish_reason, wo.stop_reason), rid
            if wo.logprobs is None:
                assert go.logprobs is None
            else:
                assert [list(e) for e in go.logprobs] == [list(e) for e in wo.logprobs], rid
                for ge, we in zip(go.logprobs, wo.logprobs, strict=True):
                    for tid, lp in we.items():
                        assert ge[tid].logprob == pytest.approx(lp.logprob, abs=1e-5)
                        assert (ge[tid].rank, ge[tid].decoded_token) == (lp.rank, lp.decoded_token)
    assert got["logprobs"].outputs[0].logprobs  # really asked for, really came
    stats = core.get_stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_total_blocks > 0  # every block free again


def test_bad_input_fails_in_the_caller_and_aborts_free_the_core(
    engines: tuple[EngineCoreClient, LLMEngine],
) -> None:
    core, _ = engines
    with pytest.raises(ValueError, match="max_model_len"):
        core.add_request("too-long", [1] * 100_000, SamplingParams())
    with pytest.raises(ValueError, match="out of range"):
        core.add_request("bad-id", [10**9], SamplingParams())
    assert not core.has_unfinished_requests()  # nothing half-submitted
    core.add_request("long", mixed_prompts()[0], SamplingParams(max_tokens=500, ignore_eos=True))
    with pytest.raises(ValueError, match="already in use"):
        core.add_request("long", [1, 2], SamplingParams())
    deadline = time.monotonic() + 60
    first: list[RequestOutput] = []
    while not first:  # running: it produced a token
        assert time.monotonic() < deadline
        first = [o for o in core.step() if o.request_id == "long"]
    assert core.get_stats().num_free_blocks < core.get_stats().num_total_blocks
    core.abort_request("long")
    ended: list[RequestOutput] = []
    while core.has_request("long"):
        assert time.monotonic() < deadline
        ended += [o for o in core.step() if o.finished]
    assert [o.outputs[0].finish_reason for o in ended] == ["abort"]
    assert len(first[0].outputs[0].token_ids) + len(ended[0].outputs[0].token_ids) < 500
    stats = core.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_a_killed_core_fails_the_client_with_a_clear_error() -> None:
    client = create_engine(_config(), core_process=True)
    try:
        (pid,) = client.rank_pids
        client.add_request("r", [1, 2, 3], SamplingParams(max_tokens=1000, ignore_eos=True))
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(
            RuntimeError, match=rf"the engine core \(pid {pid}\) exited with code -9"
        ):
            while time.monotonic() - start < 30:
                client.step()
        assert time.monotonic() - start < 5
        assert not client.has_unfinished_requests()  # nobody may wait for them
        for call in (client.step, client.check_health):
            with pytest.raises(RuntimeError, match="the engine core"):
                call()
        with pytest.raises(RuntimeError, match="the engine core"):
            client.add_request("later", [1, 2, 3], SamplingParams())
    finally:
        client.shutdown()


def test_wakeup_ends_a_step_waiting_for_outputs(
    engines: tuple[EngineCoreClient, LLMEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server's handler hands a request over while the engine thread waits in `step()`: the
    wait ends at once instead of at its timeout."""
    import threading

    from tokenwise.engine import core_client

    core, _ = engines
    (pid,) = core.rank_pids
    core.add_request("held", [1, 2, 3], SamplingParams(max_tokens=400, ignore_eos=True))
    os.kill(pid, signal.SIGSTOP)  # a core that produces nothing for now
    try:
        while core.step():  # drain what it sent before it stopped
            pass
        assert core.has_request("held")
        monkeypatch.setattr(core_client, "STEP_WAIT_S", 20.0)
        timer = threading.Timer(0.3, core.wakeup)
        timer.start()
        start = time.monotonic()
        assert core.step() == []
        assert 0.2 < time.monotonic() - start < 10  # woken, not timed out (20 s)
        timer.join()
    finally:
        os.kill(pid, signal.SIGCONT)
    monkeypatch.undo()
    core.abort_request("held")
    while core.has_request("held"):
        core.step()
