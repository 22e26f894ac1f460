"""Data parallelism across hosts, played on one machine: two launches on loopback.

The front end (`LLM(..., data_parallel_size=2, data_parallel_size_local=1)`, as `tokenwise
serve` would on the first host) runs rank 0 and waits for rank 1, which a second launch,
`tokenwise serve MODEL --headless --data-parallel-start-rank 1`, starts as the second host
would: its core connects over TCP to 127.0.0.1 and joins the DP group there. Tokens must equal
transformers' for a dense model and for an MoE model (whose ranks step in lock-step and
exchange tokens every layer over gloo); a host killed mid-request, or one that never starts,
must end in a bounded time with an error naming the rank and the address.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engine._fixtures import LLAMA, NUM_BLOCKS, checkpoint, hf_greedy, mixed_prompts
from tokenwise import LLM, SamplingParams
from tokenwise.distributed.tp_state import free_port

MIXTRAL = "MixtralForCausalLM"
MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
ROOT = Path(__file__).resolve().parents[2]


class Host:
    """A headless launch (`tokenwise serve --headless`) in its own session: killing the
    session is what a host dying looks like from the front end."""

    def __init__(self, path: str, port: int, log: Path) -> None:
        self.log = log
        cmd = [
            sys.executable,
            "-m",
            "tokenwise.entrypoints.cli",
            "serve",
            path,
            "--headless",
            "--dtype",
            "float32",
            "--num-gpu-blocks",
            str(NUM_BLOCKS),
            "--data-parallel-size",
            "2",
            "--data-parallel-start-rank",
            "1",
            "--data-parallel-address",
            "127.0.0.1",
            "--data-parallel-rpc-port",
            str(port),
        ]
        env = dict(os.environ, TOKENWISE_ENGINE_READY_TIMEOUT_S="60")
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def kill(self) -> None:
        if self.proc.poll() is None or _session_alive(self.proc.pid):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(10)

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def _session_alive(sid: int) -> bool:
    try:
        os.killpg(sid, 0)
    except ProcessLookupError:
        return False
    return True


def _front_end(path: str, port: int) -> LLM:
    return LLM(
        path,
        dtype="float32",
        num_gpu_blocks=NUM_BLOCKS,
        data_parallel_size=2,
        data_parallel_size_local=1,
        data_parallel_rpc_port=port,
    )


@pytest.fixture
def two_hosts(tmp_path: Path) -> Iterator:
    """`two_hosts(arch)` -> (front end LLM, checkpoint path, headless Host, rpc port)."""
    started: list[tuple[LLM | None, Host]] = []

    def start(arch: str) -> tuple[LLM, str, Host, int]:
        path, port = checkpoint(arch), free_port()
        host = Host(path, port, tmp_path / f"headless-{len(started)}.log")
        started.append((None, host))
        llm = _front_end(path, port)
        started[-1] = (llm, host)
        return llm, path, host, port

    yield start
    for llm, host in started:
        if llm is not None:
            llm.shutdown()
        try:
            host.proc.wait(30)
        finally:
            host.kill()


def _assert_hf_tokens_from_both_ranks(llm: LLM, path: str) -> None:
    prompts = mixed_prompts()[:4]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [
        hf_greedy(path, p, MAX_TOKENS) for p in prompts
    ]
    per_rank = [s.generation_tokens_total for s in llm.llm_engine.get_rank_stats()]
    assert all(n > 0 for n in per_rank), per_rank  # the remote rank served requests too
    # One request: the other rank is idle; under MoE it must still join every exchange.
    out = llm.generate(prompts[1:2], GREEDY, use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(path, prompts[1], MAX_TOKENS)


@pytest.mark.timeout(180)
def test_dense_model_on_two_hosts_gives_hf_tokens_and_stops_both(two_hosts) -> None:
    llm, path, host, _ = two_hosts(LLAMA)
    _assert_hf_tokens_from_both_ranks(llm, path)
    llm.shutdown()
    assert host.proc.wait(30) == 0, host.output()  # the front end stopped the other host


@pytest.mark.timeout(180)
def test_moe_on_two_hosts_steps_in_lockstep_and_a_killed_host_is_named(two_hosts) -> None:
    llm, path, host, port = two_hosts(MIXTRAL)
    _assert_hf_tokens_from_both_ranks(llm, path)  # tokens exchanged over gloo across "hosts"
    # Now the host dies mid-request; the surviving rank is inside a collective with it.
    client = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    for i, prompt in enumerate(mixed_prompts()[:4]):
        client.add_request(f"r{i}", prompt, params)
    on_rank1 = {rid for rid, record in client.groups.items() if record[0] == 1}
    assert on_rank1
    deadline = time.monotonic() + 60
    while not on_rank1 & {o.request_id for o in client.step()}:  # rank 1 is generating
        assert time.monotonic() < deadline, host.output()
    host.kill()
    killed = time.monotonic()
    expected = (
        rf"data-parallel rank 1 on host \S+ \(pid {host.proc.pid}\) lost its connection to the "
        rf"front end at 127\.0\.0\.1:{port}"
    )
    with pytest.raises(RuntimeError, match=expected):
        while time.monotonic() - killed < 30:
            client.step()
    assert time.monotonic() - killed < 10
    assert not client.has_unfinished_requests()  # nothing is left waiting for the dead host
    with pytest.raises(RuntimeError, match="data-parallel rank 1"):  # and it keeps saying so
        llm.generate(mixed_prompts()[:1], GREEDY, use_tqdm=False)


@pytest.mark.timeout(120)
def test_a_host_that_never_starts_fails_start_up_naming_the_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TOKENWISE_ENGINE_READY_TIMEOUT_S", "3")
    port = free_port()
    start = time.monotonic()
    expected = (
        rf"data-parallel rank\(s\) \[1\] never connected to the front end at "
        rf"127\.0\.0\.1:{port} within 3 s"
    )
    with pytest.raises(RuntimeError, match=expected):
        _front_end(checkpoint(LLAMA), port)
    assert time.monotonic() - start < 30
