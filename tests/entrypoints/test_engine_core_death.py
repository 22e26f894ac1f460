"""A server whose engine-core process dies answers 503 and exits non-zero within 5 s.

`tokenwise serve` runs its engine core in a child process. Killing that process (as the
kernel's out-of-memory killer would) must not leave a server that accepts connections and
never answers: in-flight requests end with an `engine_dead` error, new ones get 503, and the
server exits with status 1, whether the core died mid-request or while the server was idle.
The server runs with a planted per-step delay (`_slow_step_serve`), so a request is surely
still generating when the core is killed.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.entrypoints._server import RemoteServer
from tests.tiny_checkpoints import build_tiny_checkpoint

LAUNCHER = ("-m", "tests.entrypoints._slow_step_serve")
EXIT_BOUND_S = 5.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("core-death"))


def _engine_core_pid(server_pid: int) -> int:
    """The server's engine-core child: spawned by multiprocessing (`spawn_main`), unlike its
    resource tracker."""
    children: list[int] = []
    for task in os.listdir(f"/proc/{server_pid}/task"):
        with open(f"/proc/{server_pid}/task/{task}/children") as f:
            children += [int(pid) for pid in f.read().split()]
    cores = []
    for pid in children:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                cores.append(pid)
    assert len(cores) == 1, (children, cores)
    return cores[0]


def _stream(server: RemoteServer, started: threading.Event, out: dict) -> None:
    body = {"prompt": "the quick brown fox", "max_tokens": 200, "ignore_eos": True, "stream": True}
    out.update(events=[], error=None)
    try:
        with httpx.stream("POST", server.url("/v1/completions"), json=body, timeout=60.0) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    out["events"].append(json.loads(line[6:]))
                    started.set()
    except httpx.HTTPError as exc:
        out["error"] = type(exc).__name__
    finally:
        started.set()


@pytest.mark.timeout(240)
def test_killing_the_core_mid_request_ends_the_request_and_the_server(model_dir: str) -> None:
    with RemoteServer(model_dir, launcher=LAUNCHER) as server:
        core = _engine_core_pid(server.proc.pid)
        started, out = threading.Event(), {}
        client = threading.Thread(target=_stream, args=(server, started, out))
        client.start()
        assert started.wait(60) and out["events"], out  # tokens are flowing
        os.kill(core, signal.SIGKILL)
        killed = time.monotonic()
        code = server.proc.wait(timeout=60)
        took = time.monotonic() - killed
        client.join(30)
        assert code == 1, server.log()
        assert took < EXIT_BOUND_S, f"exited {took:.1f} s after the core died"
        # The stream ended with an error event naming the dead core, not silently.
        errors = [e["error"] for e in out["events"] if "error" in e]
        assert out["error"] is None and len(errors) == 1, out
        assert errors[0]["code"] == "engine_dead" and "engine core" in errors[0]["message"]
        assert "the engine loop died" in server.log()


@pytest.mark.timeout(240)
def test_killing_the_core_of_an_idle_server_ends_the_server(model_dir: str) -> None:
    with RemoteServer(model_dir, launcher=LAUNCHER) as server:
        body = {"prompt": "hello", "max_tokens": 2}
        assert httpx.post(server.url("/v1/completions"), json=body, timeout=60).status_code == 200
        os.kill(_engine_core_pid(server.proc.pid), signal.SIGKILL)
        killed = time.monotonic()
        answers = []
        while server.proc.poll() is None and time.monotonic() - killed < 60:
            try:  # until it exits, the server says it cannot serve
                answers.append(httpx.post(server.url("/v1/completions"), json=body, timeout=5))
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        took = time.monotonic() - killed
        assert server.proc.wait(timeout=5) == 1, server.log()
        assert took < EXIT_BOUND_S, f"exited {took:.1f} s after the core died"
        assert all(a.status_code == 503 for a in answers), [a.text for a in answers]
