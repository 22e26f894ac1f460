"""The server's control routes (`serving_dev.py`) on a real `tokenwise serve` with its engine
core process: sleep / wake-up, 503 while asleep or paused, weight updates from a path and the
weight-version header. One server for the module (starting one dominates the cost).

Expected completions come from Hugging Face greedy decoding on the same weights.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from tests.engine._fixtures import LLAMA, checkpoint, hf_greedy
from tests.entrypoints._server import RemoteServer, free_port
from tests.tiny_checkpoints import tiny_tokenizer

PROMPT = "the quick brown fox"
MAX_TOKENS = 8
HEADER = "x-tokenwise-weight-version"
MODEL = checkpoint()


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    env = {"TOKENWISE_SERVER_DEV_MODE": "1"}
    with RemoteServer(MODEL, "--enable-sleep-mode", "--served-model-name", "tiny", env=env) as srv:
        yield srv


def _complete(server: RemoteServer) -> httpx.Response:
    body = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    return httpx.post(server.url("/v1/completions"), json=body, timeout=120)


def _hf_text(path: str) -> str:
    tok = tiny_tokenizer()
    ids = tok.encode(PROMPT)
    # The server holds back a trailing incomplete UTF-8 sequence that decode shows as U+FFFD.
    return tok.decode(hf_greedy(path, ids, MAX_TOKENS)).rstrip("\ufffd")


def _is(server: RemoteServer, path: str) -> bool:
    response = httpx.get(server.url(path), timeout=60)
    assert response.status_code == 200, response.text
    return next(iter(response.json().values()))


def test_sleep_refuses_requests_with_503_and_wakes_to_the_same_text(server: RemoteServer) -> None:
    first = _complete(server)
    assert first.status_code == 200 and first.headers[HEADER] == "0"
    text = first.json()["choices"][0]["text"]
    assert text == _hf_text(MODEL)
    slept = httpx.post(server.url("/sleep?level=1"), timeout=120)
    assert slept.status_code == 200, slept.text
    assert slept.json()["released_bytes"] > 0
    assert _is(server, "/is_sleeping")
    refused = _complete(server)
    assert refused.status_code == 503
    assert "asleep" in refused.json()["error"]["message"]
    woke = httpx.post(server.url("/wake_up"), timeout=120)
    assert woke.status_code == 200 and woke.json() == {"is_sleeping": False}
    again = _complete(server)
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == text


def test_bad_control_calls_are_400s_naming_the_problem(server: RemoteServer) -> None:
    bad = httpx.post(server.url("/sleep?level=3"), timeout=60)
    assert bad.status_code == 400 and "sleep level must be 1 or 2" in bad.text
    bad = httpx.post(server.url("/update_weights"), json={}, timeout=60)
    assert bad.status_code == 400 and '"path"' in bad.json()["error"]["message"]
    assert not _is(server, "/is_sleeping")


def test_pause_then_update_weights_from_a_path_serves_the_new_weights(
    server: RemoteServer,
) -> None:
    other = checkpoint(LLAMA, seed=1)
    assert httpx.post(server.url("/pause"), timeout=60).status_code == 200
    assert _is(server, "/is_paused")
    refused = _complete(server)
    assert refused.status_code == 503 and "paused" in refused.json()["error"]["message"]
    updated = httpx.post(server.url("/update_weights"), json={"path": other}, timeout=300)
    assert updated.status_code == 200, updated.text
    assert updated.json()["weight_version"] == 1
    assert httpx.post(server.url("/resume"), timeout=60).status_code == 200
    response = _complete(server)
    assert response.status_code == 200 and response.headers[HEADER] == "1"
    assert response.json()["choices"][0]["text"] == _hf_text(other) != _hf_text(MODEL)


def test_a_trainer_pushes_weights_through_the_transfer_routes(server: RemoteServer) -> None:
    pushed = checkpoint(LLAMA, seed=2)
    port = free_port()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    trainer = subprocess.Popen(
        [sys.executable, "-m", "tests.executor._trainer", "127.0.0.1", str(port), "2", pushed],
        cwd=root,
        env={**os.environ, "PYTHONPATH": root},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        info = {"master_address": "127.0.0.1", "master_port": port, "world_size": 2}
        joined = httpx.post(
            server.url("/init_weight_transfer_engine"), json={"init_info": info}, timeout=180
        )
        assert joined.status_code == 200, joined.text
        updated = httpx.post(server.url("/update_weights"), json={"update_info": {}}, timeout=180)
        out, _ = trainer.communicate(timeout=60)
    finally:
        if trainer.poll() is None:
            trainer.kill()
    assert trainer.returncode == 0, out
    assert updated.status_code == 200, updated.text
    version = updated.json()["weight_version"]
    response = _complete(server)
    assert response.status_code == 200 and response.headers[HEADER] == str(version)
    assert response.json()["choices"][0]["text"] == _hf_text(pushed) != _hf_text(MODEL)
