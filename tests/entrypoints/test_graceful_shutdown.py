"""SIGTERM drains: admission stops, in-flight requests finish (up to --shutdown-timeout), exit 0.

The server runs with a planted per-step delay (`_slow_step_serve`, at least 0.1 s a step), so a
request of N tokens is certainly still generating when the signal arrives, whatever the load.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from tests.entrypoints._server import RemoteServer
from tests.tiny_checkpoints import build_tiny_checkpoint

NAME = "tiny"
LAUNCHER = ("-m", "tests.entrypoints._slow_step_serve")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("graceful"))


def _stream(server: RemoteServer, max_tokens: int, started: threading.Event, out: dict) -> None:
    """One streamed completion; records its tokens, finish reason and whether [DONE] came."""
    body = {
        "model": NAME,
        "prompt": "the quick brown fox",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "logprobs": 0,
        "stream": True,
    }
    out.update(tokens=0, finish=None, done=False, error=None)
    try:
        with httpx.stream(
            "POST", server.url("/v1/completions"), json=body, timeout=60.0
        ) as response:
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    out["done"] = True
                    continue
                choice = json.loads(line[6:])["choices"][0]
                out["tokens"] += len(choice["logprobs"]["tokens"])
                out["finish"] = choice["finish_reason"] or out["finish"]
                started.set()
    except httpx.HTTPError as exc:  # the connection cut by a shutdown past its timeout
        out["error"] = type(exc).__name__
    finally:
        started.set()


def _terminate_while_streaming(server: RemoteServer, max_tokens: int) -> tuple[dict, float]:
    out: dict = {}
    started = threading.Event()
    client = threading.Thread(target=_stream, args=(server, max_tokens, started, out))
    client.start()
    assert started.wait(60), "the stream never started"
    assert out["tokens"] >= 1 and out["finish"] is None  # generating, not done
    sent = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    with pytest.raises(httpx.TransportError):  # admission stopped: nothing listens
        httpx.get(server.url("/health"), timeout=5.0)
    client.join(60)
    assert not client.is_alive()
    server.proc.wait(timeout=60)
    return out, time.monotonic() - sent


def test_sigterm_lets_in_flight_requests_finish_then_exits_0(model_dir: str) -> None:
    server = RemoteServer(
        model_dir, "--served-model-name", NAME, "--shutdown-timeout", "30", launcher=LAUNCHER
    )
    try:
        # 30 tokens take at least 3 s at 0.1 s a step: certainly in flight at the signal.
        out, _ = _terminate_while_streaming(server, 30)
        assert out == {"tokens": 30, "finish": "length", "done": True, "error": None}
        assert server.proc.returncode == 0, server.log()
    finally:
        server.stop()


def test_the_drain_ends_at_the_timeout_and_still_exits_0(model_dir: str) -> None:
    server = RemoteServer(
        model_dir, "--served-model-name", NAME, "--shutdown-timeout", "1", launcher=LAUNCHER
    )
    try:
        # 500 tokens would take at least 50 s: the 1 s drain cuts the request short.
        out, took = _terminate_while_streaming(server, 500)
        assert out["tokens"] < 500 and out["finish"] != "length"
        assert server.proc.returncode == 0, server.log()
        assert took < 20, f"exited {took:.1f} s after SIGTERM with a 1 s drain"
    finally:
        server.stop()
