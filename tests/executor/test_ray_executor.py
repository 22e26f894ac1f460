"""The Ray executor: TP/PP ranks as Ray actors on a two-node Ray cluster (issue #48).

On the suite's `two_ray_nodes` (two raylets of one CPU each, playing two hosts; one cluster
for the module): TP=2 and PP=2 engines whose other rank is a Ray actor give HF's greedy tokens,
with one bundle per rank, so the driver's rank takes the CPU of its node and the actor runs on
the other node; `collective_rpc` reaches the actor. Killing the actor (`ray.kill`) while
`generate` runs ends it within the bound with an error naming the rank, and frees the placement
group; `tokenwise serve` with the Ray backend whose actor dies while idle answers 503 and exits 1.
Without a cluster: the placement's rules (rank 0's bundle, the rendezvous beyond loopback and
its secret) and the setting's validation.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import torch.distributed as dist

ray = pytest.importorskip("ray", reason="the Ray executor's tests need ray (.[ray])")

from ray.util import placement_group_table  # noqa: E402

from tests.engine._fixtures import checkpoint, hf_greedy  # noqa: E402
from tests.entrypoints._server import RemoteServer  # noqa: E402
from tests.executor import _rpc  # noqa: E402
from tokenwise import LLM, SamplingParams  # noqa: E402
from tokenwise.config import ParallelConfig  # noqa: E402
from tokenwise.distributed.rendezvous import (  # noqa: E402
    SECRET_ENV,
    WorkerLostError,
    arrival_key,
    arrival_proof,
    wait_for_arrivals,
)
from tokenwise.executor import ray_placement, ray_workers  # noqa: E402
from tokenwise.executor.executor import RayExecutor  # noqa: E402

PROMPTS = [[5, 17, 42, 99, 7, 3], [11, 12, 13, 14, 15, 16, 17, 18]]
MAX_TOKENS = 6
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
BOUND_S = 60.0


def _tokens(llm: LLM, params: SamplingParams = GREEDY) -> list[list[int]]:
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def _hf_tokens() -> list[list[int]]:
    return [hf_greedy(checkpoint(), p, MAX_TOKENS) for p in PROMPTS]


def _free_cpus() -> float:
    return ray.available_resources().get("CPU", 0.0)


def _wait_all_free() -> float:
    """The cluster's free CPUs once an engine's actors and group are gone (bounded)."""
    deadline = time.monotonic() + 15
    while _free_cpus() < 2.0 and time.monotonic() < deadline:
        time.sleep(0.2)
    return _free_cpus()


def _ray_llm(**parallel: Any) -> LLM:
    return LLM(
        checkpoint(),
        dtype="float32",
        num_gpu_blocks=64,
        distributed_executor_backend="ray",
        **parallel,
    )


def _kill_during_generate(llm: LLM, kill: Callable[[], None], after_steps: int = 3) -> None:
    """Make the `after_steps`-th engine step of the next `generate` kill the actor first."""
    engine = llm.llm_engine
    step_once, steps = engine.step, [0]

    def step() -> Any:
        steps[0] += 1
        if steps[0] == after_steps:
            kill()
        return step_once()

    engine.step = step  # type: ignore[method-assign]


def _killed_generate_fails_naming(llm: LLM, kill: Callable[[], None], name: str) -> None:
    _kill_during_generate(llm, kill)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=name):
        _tokens(llm, LONG)
    assert time.monotonic() - started < BOUND_S
    with pytest.raises(RuntimeError):  # and the engine stays failed
        _tokens(llm)


@pytest.mark.timeout(300, method="thread")
def test_tp2_actor_on_the_other_node_gives_hf_tokens_then_its_kill_is_named(
    two_ray_nodes: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ranks meet as on two hosts: at the driver node's address, proving the secret (the
    cluster's nodes share this machine's address, so the placement alone would pick
    loopback, which the PP test covers)."""
    node_ip = ray.util.get_node_ip_address()
    monkeypatch.setattr(ray_workers, "rendezvous_host", lambda *_: node_ip)
    monkeypatch.setenv(SECRET_ENV, "test-secret")  # the actor gets it with TOKENWISE_*
    expected = _hf_tokens()
    llm = _ray_llm(tensor_parallel_size=2)
    try:
        executor = llm.llm_engine.model_executor
        assert isinstance(executor, RayExecutor)
        workers = executor.driver_worker.tp.workers
        assert workers.init_method.startswith(f"tcp://{node_ip}:")
        here = ray.get_runtime_context().get_node_id()
        # The driver's rank on this node, rank 1's actor on the other: both nodes in use.
        assert {here, workers.procs[0].node_id} == {n["NodeID"] for n in ray.nodes()}
        assert _free_cpus() == 0.0  # one bundle per rank, the driver's included
        assert _tokens(llm) == expected
        results = llm.collective_rpc(_rpc.describe_rank, args=("r",))
        assert [r["tp_rank"] for r in results] == [0, 1]
        assert results[1]["pid"] == workers.procs[0].pid != os.getpid()
        group = workers._placement
        _killed_generate_fails_naming(
            llm, workers.procs[0].kill, r"tensor-parallel worker 1 \(pid \d+\) exited"
        )
        assert placement_group_table(group)["state"] == "REMOVED"  # freed with the failure
    finally:
        llm.shutdown()
    assert _wait_all_free() == 2.0  # no actor, no placement group left


@pytest.mark.timeout(300, method="thread")
def test_pp2_stage_on_the_other_node_gives_hf_tokens_then_its_kill_is_named(
    two_ray_nodes: Any,
) -> None:
    expected = _hf_tokens()
    llm = _ray_llm(pipeline_parallel_size=2)
    try:
        workers = llm.llm_engine.model_executor.driver_worker.pipeline.workers
        here = ray.get_runtime_context().get_node_id()
        assert len(workers.procs) == 1 and workers.procs[0].node_id != here
        assert _tokens(llm) == expected
        _killed_generate_fails_naming(
            llm, workers.procs[0].kill, r"pipeline stage 1 \(pid \d+\) exited"
        )
        assert placement_group_table(workers._placement)["state"] == "REMOVED"
    finally:
        llm.shutdown()
    assert _wait_all_free() == 2.0


@pytest.mark.timeout(120, method="thread")
def test_a_strategy_the_cluster_cannot_meet_fails_start_up_by_name(
    two_ray_nodes: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ray_placement, "PLACEMENT_TIMEOUT_S", 2.0)
    with pytest.raises(RuntimeError, match=r"could not place 2 .*STRICT_PACK"):
        _ray_llm(tensor_parallel_size=2, ray_placement_strategy="STRICT_PACK")  # 1 CPU a node
    assert all(g["state"] == "REMOVED" for g in placement_group_table().values())


def _rank_actor_pids() -> list[int]:
    """Processes running a rank actor (Ray titles them after the actor's class)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if f.read().startswith(b"ray::_RankActor"):
                        pids.append(int(entry))
            except OSError:
                pass
    return pids


@pytest.mark.timeout(300, method="thread")
def test_serve_answers_503_and_exits_when_its_idle_rank_actor_dies(two_ray_nodes: Any) -> None:
    """Killed between requests: the engine core's idle health check finds it (no request has
    to fail first), /health turns 503, and the server exits 1. (A request to a dead engine
    is answered 503: `tests/entrypoints/test_engine_core_death.py`.)"""
    env = {"RAY_ADDRESS": two_ray_nodes.address}
    args = ("--tensor-parallel-size", "2", "--distributed-executor-backend", "ray")
    with RemoteServer(checkpoint(), *args, env=env) as server:
        body = {"prompt": "hello", "max_tokens": 2}
        assert httpx.post(server.url("/v1/completions"), json=body, timeout=60).status_code == 200
        (actor,) = _rank_actor_pids()
        os.kill(actor, signal.SIGKILL)
        killed, health = time.monotonic(), []
        while server.proc.poll() is None and time.monotonic() - killed < BOUND_S:
            try:  # no request: the engine's idle health check must find the dead rank itself
                health.append(httpx.get(server.url("/health"), timeout=5).status_code)
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        assert server.proc.wait(timeout=5) == 1, server.log()
        assert time.monotonic() - killed < BOUND_S
        # 200 only until the engine noticed (it checks every half second), then 503 until exit.
        assert health == sorted(health) and set(health) <= {200, 503}, health
        assert "the engine loop died" in server.log()
        assert re.search(r"tensor-parallel worker 1 \(pid \d+\) exited", server.log())
        assert "continue; the engine cannot continue" not in server.log()  # said once
    assert _wait_all_free() == 2.0


class _FakeRay:
    """What the placement asks Ray: each node's address."""

    def __init__(self, addresses: dict[str, str]) -> None:
        self._addresses = addresses

    def nodes(self) -> list[dict[str, str]]:
        return [{"NodeID": n, "NodeManagerAddress": a} for n, a in self._addresses.items()]


def test_rank_zero_takes_a_bundle_on_the_driver_node() -> None:
    assert ray_placement.rank_bundles("b", {0: "a", 1: "b", 2: "a"}) == [1, 0, 2]
    with pytest.raises(RuntimeError, match="no tensor/pipeline-parallel rank's bundle on the"):
        ray_placement.rank_bundles("c", {0: "a", 1: "b"})


def test_ranks_on_other_hosts_meet_at_the_driver_address_only_with_the_secret(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    one_host = _FakeRay({"a": "10.0.0.1", "b": "10.0.0.1"})  # two raylets, one machine
    assert ray_placement.rendezvous_host(one_host, "a", {0: "a", 1: "b"}) is None
    two_hosts = _FakeRay({"a": "10.0.0.1", "b": "10.0.0.2"})
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(RuntimeError, match=rf"other hosts \(10\.0\.0\.2\).*{SECRET_ENV}"):
        ray_placement.rendezvous_host(two_hosts, "a", {0: "a", 1: "b"})
    monkeypatch.setenv(SECRET_ENV, "s3cret")
    assert ray_placement.rendezvous_host(two_hosts, "a", {0: "a", 1: "b"}) == "10.0.0.1"
    # Where the ranks then meet: a fresh port at that address; under DP the DP address.
    one_engine = SimpleNamespace(parallel=ParallelConfig())
    assert ray_placement.move_rendezvous("tcp://127.0.0.1:1", None, one_engine) == (
        "tcp://127.0.0.1:1"
    )
    moved = ray_placement.move_rendezvous("tcp://127.0.0.1:1", "127.0.0.2", one_engine)
    assert moved.startswith("tcp://127.0.0.2:") and moved != "tcp://127.0.0.2:1"
    dp_rank = SimpleNamespace(parallel=ParallelConfig(data_parallel_size=2))
    with pytest.raises(RuntimeError, match="set data_parallel_address"):
        ray_placement.move_rendezvous("tcp://127.0.0.1:1", "10.0.0.1", dp_rank)


class _Alive:
    def dead_worker(self) -> str | None:
        return None

    def missing(self, ranks: list[int]) -> str:
        return f"ranks {ranks}"

    def everyone(self) -> str:
        return "everyone"


def test_an_arrival_beyond_loopback_must_prove_the_secret(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    where = "tcp://10.0.0.1:29999"
    monkeypatch.delenv(SECRET_ENV, raising=False)
    assert arrival_proof("tcp://127.0.0.1:29999", 1) == ""  # loopback needs none
    with pytest.raises(ValueError, match=f"beyond loopback, which needs {SECRET_ENV}"):
        arrival_proof(where, 1)
    monkeypatch.setenv(SECRET_ENV, "s3cret")
    proof = arrival_proof(where, 1)
    assert proof not in ("", arrival_proof(where, 2), arrival_proof("tcp://10.0.0.1:1", 1))
    store = dist.HashStore()
    store.set(arrival_key(1), f"4321 {proof}")
    wait_for_arrivals(store, 2, 0, _Alive(), where)  # the rank that holds the secret
    store.set(arrival_key(1), "4321 forged")
    with pytest.raises(WorkerLostError, match=f"as rank 1 without {SECRET_ENV}'s proof"):
        wait_for_arrivals(store, 2, 0, _Alive(), where)
    monkeypatch.setenv(SECRET_ENV, "another")
    store.set(arrival_key(1), f"4321 {proof}")  # proved with a different secret
    with pytest.raises(WorkerLostError, match="as rank 1 without"):
        wait_for_arrivals(store, 2, 0, _Alive(), where)


def test_a_placement_strategy_outside_rays_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"ray_placement_strategy must be one of PACK, SPREAD"):
        ParallelConfig(ray_placement_strategy="pack")
    assert ParallelConfig().ray_placement_strategy == "PACK"
