"""`TOKENWISE_SERVER_NICE`: the API process lowers every thread's priority, its value checked.

The server-level check (its engine core keeps the priority the server started with) is in
tests/entrypoints/test_async_scheduling_server.py, beside a running server."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tokenwise.entrypoints.openai.server_priority import NICE_ENV, server_nice

REPO = str(Path(__file__).resolve().parents[2])
# Run in a child: a lowered priority cannot be raised again without privileges.
CHILD = """
import os, threading
from tokenwise.entrypoints.openai.server_priority import yield_to_engine_cores
gate = threading.Event()
worker = threading.Thread(target=gate.wait)
worker.start()
before = os.getpriority(os.PRIO_PROCESS, 0)
after = yield_to_engine_cores()
tids = [int(t) for t in os.listdir("/proc/self/task")]
print(before, after, *sorted({os.getpriority(os.PRIO_PROCESS, t) for t in tids}))
gate.set()
"""


@pytest.mark.parametrize("raw, want", [("", 0), ("10", 10), (" 19 ", 19)])
def test_server_nice_values(monkeypatch: pytest.MonkeyPatch, raw: str, want: int) -> None:
    if raw:
        monkeypatch.setenv(NICE_ENV, raw)
    else:
        monkeypatch.delenv(NICE_ENV, raising=False)
    assert server_nice() == want


@pytest.mark.parametrize("raw", ["-1", "20", "high"])
def test_bad_server_nice_names_the_variable(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv(NICE_ENV, raw)
    with pytest.raises(ValueError, match=rf"{NICE_ENV} must be .*\[0, 19\].*{raw!r}|{raw}"):
        server_nice()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="Linux thread priorities")
def test_every_thread_is_lowered() -> None:
    env = {**os.environ, NICE_ENV: "3", "PYTHONPATH": REPO}
    out = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    before, after, *threads = map(int, out.stdout.split())
    assert after == min(19, before + 3)
    assert threads == [after]  # the main thread and the one started before: one value
