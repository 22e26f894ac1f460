"""Data-parallel ranks as Ray actors (`data_parallel_backend="ray"`) on a two-node Ray cluster.

`ray.cluster_utils.Cluster` plays two hosts with one CPU each on this machine (the suite's
`two_ray_nodes` fixture, shared by the module: a cluster start costs seconds). DP=2 as actors
must give DP=1's greedy tokens with one rank on each node; a killed rank actor must end the running `generate` with an error naming
the rank within the bound; shutting down must leave no actor and no placement group (every CPU
of the cluster free again).
"""

from __future__ import annotations

import time

import pytest

ray = pytest.importorskip("ray", reason="Ray data parallelism needs ray (.[ray])")

from ray.cluster_utils import Cluster  # noqa: E402
from ray.util import placement_group_table  # noqa: E402

from tests.engine._fixtures import NUM_BLOCKS, checkpoint, mixed_prompts  # noqa: E402
from tokenwise import LLM, SamplingParams  # noqa: E402
from tokenwise.config import ParallelConfig  # noqa: E402
from tokenwise.distributed.tp_state import free_port  # noqa: E402
from tokenwise.engine import ray_ranks  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
BOUND_S = 30.0


def _free_cpus_after(llm: LLM) -> float:
    """Shut `llm` down; the cluster's free CPUs once its actors and group are gone (bounded)."""
    llm.shutdown()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if ray.available_resources().get("CPU", 0.0) == 2.0:
            break
        time.sleep(0.2)
    return ray.available_resources().get("CPU", 0.0)


def _ray_llm(size: int = 2) -> LLM:
    return LLM(
        checkpoint(),
        dtype="float32",
        num_gpu_blocks=NUM_BLOCKS,
        data_parallel_size=size,
        data_parallel_backend="ray",
        data_parallel_rpc_port=free_port("127.0.0.1"),  # not the fixed default: tests share hosts
    )


@pytest.mark.timeout(300, method="thread")
def test_ray_ranks_on_two_nodes_serve_then_a_killed_one_is_named(two_ray_nodes: Cluster) -> None:
    """One engine start for both halves (an actor start imports torch: seconds each)."""
    prompts = mixed_prompts()[:4]
    single = LLM(checkpoint(), dtype="float32", num_gpu_blocks=NUM_BLOCKS)
    expected = [o.outputs[0].token_ids for o in single.generate(prompts, GREEDY, use_tqdm=False)]
    single.shutdown()
    llm = _ray_llm()
    try:
        cores = llm.llm_engine._procs
        group = cores._group
        nodes = placement_group_table(group)["bundles_to_node_id"]
        assert len(set(nodes.values())) == 2  # one rank per "host"
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert got == expected
        served = [s.generation_tokens_total for s in llm.llm_engine.get_rank_stats()]
        assert all(n > 0 for n in served), served  # both actors served requests
        assert ray.available_resources().get("CPU", 0.0) == 0.0  # one bundle per rank

        # Kill rank 1 while both ranks have a request in flight.
        client = llm.llm_engine
        long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        for i, prompt in enumerate(prompts[:2]):
            client.add_request(f"long-{i}", {"prompt_token_ids": prompt}, long)
        deadline = time.monotonic() + BOUND_S
        while not client.step() and time.monotonic() < deadline:
            pass  # until the first tokens come back
        assert client.get_num_unfinished_requests() == 2
        cores[1].kill()
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r"data-parallel rank 1 \(pid \d+\)"):
            while time.monotonic() - started < BOUND_S:
                client.step()
        assert time.monotonic() - started < BOUND_S
        assert client.get_num_unfinished_requests() == 0  # nobody waits for them any more
        with pytest.raises(RuntimeError, match="data-parallel rank 1"):  # and stays failed
            llm.generate(["again"], GREEDY, use_tqdm=False)
    finally:
        free = _free_cpus_after(llm)
    assert free == 2.0  # no actor left: every CPU of the cluster is free again
    assert placement_group_table(group)["state"] == "REMOVED"


def test_bad_ray_data_parallel_settings_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="data_parallel_backend must be 'mp' or 'ray'"):
        ParallelConfig(data_parallel_size=2, data_parallel_backend="k8s")
    with pytest.raises(ValueError, match="data_parallel_size_local .* do not apply"):
        ParallelConfig(
            data_parallel_size=2, data_parallel_backend="ray", data_parallel_size_local=1
        )
    # One rank needs no actors: the backend applies from two ranks on.
    assert ParallelConfig(data_parallel_backend="ray").local_dp_size == 1


def test_what_ray_ranks_do_not_support_is_refused_before_any_actor(two_ray_nodes: Cluster) -> None:
    for extra, what in (
        ({"enable_lora": True}, "enable_lora is not supported with data_parallel_backend='ray'"),
        (
            {"tensor_parallel_size": 2},
            "tensor_parallel_size must be 1 with data_parallel_backend='ray'",
        ),
    ):
        with pytest.raises(ValueError, match=what):
            LLM(
                checkpoint(),
                dtype="float32",
                data_parallel_size=2,
                data_parallel_backend="ray",
                **extra,
            )
    assert ray.available_resources().get("CPU", 0.0) == 2.0  # nothing was placed


def test_ranks_the_cluster_has_no_room_for_fail_start_up_within_the_bound(
    two_ray_nodes: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ray_ranks, "PLACEMENT_TIMEOUT_S", 2.0)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"could not place 3 data-parallel rank\(s\)"):
        _ray_llm(size=3)  # two nodes of one CPU each
    assert time.monotonic() - started < 30
    groups = placement_group_table().values()
    assert all(g["state"] == "REMOVED" for g in groups)  # the pending group was removed


class _FakeRay:
    """What `_rank_order` asks Ray: the driver's node and each node's address."""

    def __init__(self, here: str, addresses: dict[str, str]) -> None:
        self._here, self._addresses = here, addresses

    def get_runtime_context(self) -> _FakeRay:
        return self

    def get_node_id(self) -> str:
        return self._here

    def nodes(self) -> list[dict[str, str]]:
        return [{"NodeID": n, "NodeManagerAddress": a} for n, a in self._addresses.items()]


def test_rank_zero_goes_to_the_front_ends_node_and_other_hosts_need_an_address() -> None:
    same_host = _FakeRay("b", {"a": "10.0.0.1", "b": "10.0.0.1"})  # two raylets, one host
    assert ray_ranks._rank_order(same_host, {0: "a", 1: "a", 2: "b"}, "127.0.0.1") == [2, 0, 1]
    with pytest.raises(RuntimeError, match="no data-parallel rank on the front end's node"):
        ray_ranks._rank_order(same_host, {0: "a", 1: "a"}, "127.0.0.1")
    two_hosts = _FakeRay("a", {"a": "10.0.0.1", "b": "10.0.0.2"})
    with pytest.raises(RuntimeError, match=r"other hosts \(10\.0\.0\.2\).*data_parallel_address"):
        ray_ranks._rank_order(two_hosts, {0: "a", 1: "b"}, "127.0.0.1")
    # Given an address the other host can reach, it is the secret's business (checked before).
    assert ray_ranks._rank_order(two_hosts, {0: "b", 1: "a"}, "10.0.0.1") == [1, 0]
