"""The Ray executor: the other tensor-parallel rank as a Ray actor in a placement group.

On a local Ray instance (started once for the module, as a user without a cluster gets it): a
TP=2 engine whose second rank is a Ray actor gives the same tokens as one process, and
`collective_rpc` reaches the actor (another process, the same rank order); an actor that dies
ends the next step with an error naming it within the bound, and the engine is refused after;
shutting down leaves no actor and no placement group.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

ray = pytest.importorskip("ray", reason="the Ray executor's tests need ray (.[ray])")

from tests.engine._fixtures import checkpoint  # noqa: E402
from tests.executor import _rpc  # noqa: E402
from tokenwise import LLM, SamplingParams  # noqa: E402
from tokenwise.executor.executor import RayExecutor  # noqa: E402

PROMPTS = ["the quick brown fox", "one two three four five"]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
BOUND_S = 60.0


def _tokens(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _reserved_cpus() -> float:
    """CPUs held by placement groups and actors (0 once nothing of an engine is left)."""
    return ray.cluster_resources()["CPU"] - ray.available_resources().get("CPU", 0.0)


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _ray_llm() -> LLM:
    return LLM(
        checkpoint(),
        dtype="float32",
        num_gpu_blocks=64,
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
    )


@pytest.mark.timeout(300, method="thread")
def test_a_ray_rank_gives_one_process_tokens_and_answers_rpc(local_ray: None) -> None:
    single = LLM(checkpoint(), dtype="float32", num_gpu_blocks=64)
    expected = _tokens(single)
    single.shutdown()
    llm = _ray_llm()
    try:
        assert isinstance(llm.llm_engine.model_executor, RayExecutor)
        assert _tokens(llm) == expected
        results = llm.collective_rpc(_rpc.describe_rank, args=("r",))
        assert [r["tp_rank"] for r in results] == [0, 1]
        assert results[0]["pid"] == os.getpid() and results[1]["pid"] != os.getpid()
        actor_pid = llm.llm_engine.model_executor.driver_worker.tp.workers.procs[0].pid
        assert results[1]["pid"] == actor_pid  # the rank runs in the Ray actor's process
        assert _reserved_cpus() == 1.0  # one bundle, one rank
    finally:
        llm.shutdown()
    deadline = time.monotonic() + 10
    while _reserved_cpus() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _reserved_cpus() == 0.0  # no actor and no placement group left


@pytest.mark.timeout(300, method="thread")
def test_a_dead_actor_is_named_within_the_bound(local_ray: None) -> None:
    llm = _ray_llm()
    try:
        _tokens(llm)
        handle = llm.llm_engine.model_executor.driver_worker.tp.workers.procs[0]
        handle.kill()
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r"tensor-parallel worker 1 \(pid \d+\) exited"):
            _tokens(llm)
        assert time.monotonic() - started < BOUND_S
    finally:
        llm.shutdown()
