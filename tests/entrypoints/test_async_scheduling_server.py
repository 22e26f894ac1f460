"""The server with `--async-scheduling`: concurrent streams carry the same text and finish
reasons as the synchronous engine in-process, and nothing follows a stream's final chunk."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
from openai import OpenAI

from tests.entrypoints._server import RemoteServer, openai_client
from tests.tiny_checkpoints import build_tiny_checkpoint
from tokenwise.entrypoints.llm import LLM
from tokenwise.sampling.params import SamplingParams

NAME = "tiny-llama"
PROMPTS = ["Hello world", "The cat sat on", "Once upon a time", "def f(x):"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("async-server"))


@pytest.fixture(scope="module", autouse=True)
def booting_server(model_dir: str):
    # Started first and awaited only in `client`, so `llm` loads while the server boots.
    args = ("--served-model-name", NAME, "--async-scheduling")
    env = {"TOKENWISE_SERVER_NICE": "10"}  # off by default; on here for its test below
    with RemoteServer(model_dir, *args, env=env, wait=False) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(booting_server: RemoteServer) -> OpenAI:
    return openai_client(booting_server.wait_healthy())


@pytest.fixture(scope="module")
def llm(model_dir: str) -> LLM:
    return LLM(model_dir, dtype="float32", device="cpu", kv_cache_memory=16 << 20)


def settings(i: int, stop: str | None) -> dict:
    """Request i's settings: different lengths, one ending on a stop string."""
    return {"temperature": 0.0, "max_tokens": 4 + 5 * i, "stop": [stop] if stop else None}


def test_concurrent_streams_match_sync_engine(llm: LLM, client: OpenAI) -> None:
    # A stop string from the middle of prompt 1's synchronous output ends it early.
    full = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=9), use_tqdm=False)
    text = full[0].outputs[0].text
    stop = text[len(text) // 2 :][:2] if len(text) > 4 else None
    wants = []
    for i, prompt in enumerate(PROMPTS):
        s = settings(i, stop if i == 1 else None)
        params = SamplingParams(temperature=0.0, max_tokens=s["max_tokens"], stop=s["stop"])
        wants.append(llm.generate(prompt, params, use_tqdm=False)[0].outputs[0])
    if stop is not None:
        assert wants[1].finish_reason == "stop"

    def stream(i: int) -> list:
        chunks = client.completions.create(
            model=NAME, prompt=PROMPTS[i], stream=True, **settings(i, stop if i == 1 else None)
        )
        return [c.choices[0] for c in chunks if c.choices]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(stream, range(len(PROMPTS))))
    for want, choices in zip(wants, got, strict=True):
        assert "".join(c.text for c in choices) == want.text
        finishes = [c.finish_reason for c in choices]
        assert finishes[-1] == want.finish_reason
        assert set(finishes[:-1]) <= {None}  # the final chunk is the last


def test_refusal_at_start_names_the_setting(model_dir: str) -> None:
    with pytest.raises(ValueError, match="async_scheduling=True"):
        LLM(
            model_dir,
            dtype="float32",
            async_scheduling=True,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        )


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if entry.isdigit() and int(fields[1]) == pid:
            kids.append(int(entry))
    return kids


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="Linux thread priorities")
def test_api_process_yields_to_its_engine_core(
    booting_server: RemoteServer, client: OpenAI
) -> None:
    """`TOKENWISE_SERVER_NICE=10`: the API process's threads lowered, its engine
    core left at the priority the server was started with (server_priority.py)."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    pid = booting_server.proc.pid
    tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    assert {os.getpriority(os.PRIO_PROCESS, t) for t in tids} == {min(19, base + 10)}
    cores = [k for k in _children(pid) if "spawn_main" in open(f"/proc/{k}/cmdline").read()]
    assert cores and all(os.getpriority(os.PRIO_PROCESS, k) == base for k in cores)
