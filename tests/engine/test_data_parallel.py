"""Data parallelism with a dense model: N engine processes behind one `LLM`.

Dense models need no agreement between ranks (no layer exchanges tokens), so the ranks step
independently; what is tested here is the front end: tokens equal to HF, requests spread over
ranks, bad input refused in the caller while the engine serves on, and a dead rank turning
into a clear error instead of a hang. MoE models, where ranks do step together, are in
test_moe_data_parallel.py.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

from tests.engine._fixtures import LLAMA, checkpoint, hf_greedy, mixed_prompts
from tokenwise import LLM, SamplingParams
from tokenwise.entrypoints.llm import build_engine_config

MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def dense_dp2() -> Iterator[tuple[LLM, str]]:
    path = checkpoint(LLAMA)
    llm = LLM(path, dtype="float32", data_parallel_size=2)
    yield llm, path
    llm.shutdown()


def test_dense_dp2_gives_hf_tokens_and_uses_both_ranks(dense_dp2: tuple[LLM, str]) -> None:
    llm, path = dense_dp2
    prompts = mixed_prompts()[:6]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [
        hf_greedy(path, p, MAX_TOKENS) for p in prompts
    ]
    per_rank = [s.generation_tokens_total for s in llm.llm_engine.get_rank_stats()]
    assert all(n > 0 for n in per_rank), per_rank  # least-loaded routing used both ranks
    assert sum(per_rank) >= 6 * MAX_TOKENS
    stats = llm.llm_engine.get_stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_total_blocks  # every block free again


def test_bad_request_fails_in_the_caller_and_the_engine_serves_on(
    dense_dp2: tuple[LLM, str],
) -> None:
    llm, path = dense_dp2
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[1] * 10_000], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="logprobs"):
        llm.generate([[1, 2, 3]], SamplingParams(logprobs=10**6), use_tqdm=False)
    assert not llm.llm_engine.groups  # nothing half-submitted stays behind
    prompt = mixed_prompts()[0]
    out = llm.generate([prompt], GREEDY, use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(path, prompt, MAX_TOKENS)


@pytest.mark.parametrize("lockstep", [False, True], ids=["independent", "lockstep"])
def test_killed_rank_fails_the_engine_with_a_clear_error(lockstep: bool) -> None:
    config = build_engine_config(checkpoint(LLAMA), dtype="float32", data_parallel_size=2)
    # Lock-step ranks (as for MoE models) meet in a collective every step: the survivor must
    # not wait there for the dead rank.
    config.parallel.is_moe_model = lockstep
    llm = LLM.from_engine_config(config)
    client = llm.llm_engine
    try:
        pids = client.rank_pids
        os.kill(pids[1], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"data-parallel rank 1 \(pid \d+\) exited"):
            llm.generate(mixed_prompts()[:4], GREEDY, use_tqdm=False)
        assert time.monotonic() - start < 20
        # The survivor is stopped too, not left running (or stuck in a collective).
        deadline = time.monotonic() + 10
        while _alive(pids[0]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(pids[0])
        # Later calls keep saying why, rather than hanging or failing vaguely.
        with pytest.raises(RuntimeError, match="data-parallel rank 1"):
            llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()


def _alive(pid: int | None) -> bool:
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)  # reap it if it is our zombie child
        if waited:
            return False
        os.kill(pid, 0)
    except (ChildProcessError, ProcessLookupError):
        return False
    return True
