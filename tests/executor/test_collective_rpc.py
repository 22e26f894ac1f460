"""The executor owns the workers: `collective_rpc` reaches every rank, in rank order.

One engine in this process (`UniProcExecutor`) and a TP=2 engine (`MultiprocExecutor`, the
second rank a spawned process): a function runs on every rank and sees that rank's own shard;
a failure on one rank is raised naming it and the engine serves on; a rank that does not answer
within the timeout ends the call with an error instead of a hang.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from tests.engine._fixtures import checkpoint
from tests.executor import _rpc
from tokenwise import LLM, SamplingParams

PROMPTS = ["the quick brown fox", "one two three four five"]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


def _tokens(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def single() -> Iterator[LLM]:
    llm = LLM(checkpoint(), dtype="float32", num_gpu_blocks=64)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def tp2() -> Iterator[LLM]:
    llm = LLM(checkpoint(), dtype="float32", num_gpu_blocks=64, tensor_parallel_size=2)
    yield llm
    llm.shutdown()


def test_one_process_runs_the_function_once_on_its_worker(single: LLM) -> None:
    (result,) = single.collective_rpc(_rpc.describe_rank, args=("x",))
    assert result["pid"] == os.getpid() and result["tp_rank"] == 0
    assert result["num_blocks"] == 64
    assert single.collective_rpc("check_health") == [None]


def test_every_rank_answers_in_rank_order_with_its_own_shard(single: LLM, tp2: LLM) -> None:
    (whole,) = single.collective_rpc(_rpc.describe_rank, args=("x",))
    results = tp2.collective_rpc(_rpc.describe_rank, kwargs={"tag": "y"})
    assert [r["tp_rank"] for r in results] == [0, 1]
    assert [r["tag"] for r in results] == ["y", "y"]
    assert results[0]["pid"] == os.getpid() and results[1]["pid"] != os.getpid()
    assert [r["qkv_rows"] for r in results] == [whole["qkv_rows"] // 2] * 2  # halves
    assert results[0]["num_blocks"] == results[1]["num_blocks"] == 64


def test_a_failing_rank_is_named_and_the_engine_serves_on(single: LLM, tp2: LLM) -> None:
    with pytest.raises(RuntimeError, match=r"failed on rank 1: ValueError: rank 1 refuses"):
        tp2.collective_rpc(_rpc.fail_on_rank_1)
    with pytest.raises(RuntimeError, match=r"no method 'nope'"):
        tp2.collective_rpc("nope")
    assert _tokens(tp2) == _tokens(single)  # the ranks still run steps together


@pytest.mark.timeout(120, method="thread")
def test_a_rank_that_does_not_answer_ends_the_call_in_bounded_time(tp2: LLM) -> None:
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"did not finish within 1 s"):
        tp2.collective_rpc(_rpc.sleep_on_rank_1, args=(30.0,), timeout=1.0)
    assert time.monotonic() - started < 15
