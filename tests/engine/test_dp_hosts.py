"""Data parallelism across hosts, played on one machine: two launches on loopback.

The front end (`LLM(..., data_parallel_size=2, data_parallel_size_local=1)`, as `tokenwise
serve` would on the first host) runs rank 0 and waits for rank 1, which a second launch,
`tokenwise serve MODEL --headless --data-parallel-start-rank 1`, starts as the second host
would: its core connects over TCP to 127.0.0.1 and joins the DP group there. Tokens must equal
transformers' for a dense model and for an MoE model (whose ranks step in lock-step and
exchange tokens every layer over gloo); a host killed mid-request, or one that never starts,
must end in a bounded time with an error naming the rank and the address. The dense run uses
`TOKENWISE_CLUSTER_SECRET` (CurveZMQ on every TCP socket), and strangers without it try to pose
as rank 1 and to push a forged "rank 1 died" while the engine serves: both are refused and
the engine keeps serving the ranks that hold the secret.
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
import zmq

from tests.engine._fixtures import LLAMA, NUM_BLOCKS, checkpoint, hf_greedy, mixed_prompts
from tokenwise import LLM, SamplingParams
from tokenwise.distributed.curve_auth import secure_client
from tokenwise.distributed.tp_state import free_port
from tokenwise.engine import core_messages as msg
from tokenwise.engine.remote_ranks import CURVE_DOMAIN, SECRET_ENV, rank_identity

MIXTRAL = "MixtralForCausalLM"
MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
ROOT = Path(__file__).resolve().parents[2]


class Host:
    """A headless launch (`tokenwise serve --headless`) in its own session: killing the
    session is what a host dying looks like from the front end."""

    def __init__(self, path: str, port: int, log: Path, secret: str | None = None) -> None:
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
        if secret is not None:
            env[SECRET_ENV] = secret
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
def two_hosts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator:
    """`two_hosts(arch, secret=None)` -> (front end LLM, checkpoint path, headless Host, rpc
    port); with `secret`, both ends hold it as TOKENWISE_CLUSTER_SECRET."""
    started: list[tuple[LLM | None, Host]] = []

    def start(arch: str, secret: str | None = None) -> tuple[LLM, str, Host, int]:
        path, port = checkpoint(arch), free_port()
        if secret is not None:
            monkeypatch.setenv(SECRET_ENV, secret)
        host = Host(path, port, tmp_path / f"headless-{len(started)}.log", secret)
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


def _strangers_try(llm: LLM, port: int) -> zmq.Context:
    """Without the secret (and with a wrong one): say hello as rank 1 on the RPC port, and
    push a forged "rank 1 died" to the outputs' port. Both must be refused at the handshake."""
    ctx = zmq.Context()
    output_address = llm.llm_engine._io.remote.output_address
    for secret in (None, "a guess"):
        dealer, push = ctx.socket(zmq.DEALER), ctx.socket(zmq.PUSH)
        for sock in (dealer, push):
            sock.linger = 0
            if secret is not None:
                secure_client(sock, secret, CURVE_DOMAIN)
        dealer.setsockopt(zmq.ROUTING_ID, rank_identity(1))
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send(msg.encode(msg.CoreHello(1, 2, "stranger", 1, "x")), zmq.NOBLOCK)
        push.connect(output_address)
        push.send(msg.encode(msg.CoreDead(1, "forged", "RuntimeError")), zmq.NOBLOCK)
    return ctx


@pytest.mark.timeout(180)
def test_dense_model_on_two_hosts_with_a_secret_serves_and_refuses_strangers(
    two_hosts, caplog: pytest.LogCaptureFixture
) -> None:
    llm, path, host, port = two_hosts(LLAMA, secret="s3cret")
    strangers = _strangers_try(llm, port)
    try:
        _assert_hf_tokens_from_both_ranks(llm, path)  # the forged "dead" never arrived
        assert "data parallel: refused a rank" in caplog.text
        assert llm.llm_engine._io.remote.hosts[1][0] != "stranger"
    finally:
        strangers.destroy(linger=0)
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
