"""Async scheduling (`--async-scheduling`): the same tokens, stops and outputs as a synchronous
engine, with step N+1 scheduled while step N runs.

The reference is the synchronous engine (itself checked against Hugging Face elsewhere); a
stop string and a stop token are picked from its output so that requests end mid-batch, which
is where a step scheduled ahead must discard its token for a finished request.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.engine._fixtures import (
    LLAMA,
    NUM_BLOCKS,
    assert_pool_clean,
    checkpoint,
    hf_greedy,
    random_ids,
)
from tokenwise import LLM, SamplingParams
from tokenwise.engine.async_step import check_async_engine
from tokenwise.sampling.guided.params import GuidedDecodingParams


@pytest.fixture(scope="module")
def path() -> str:
    return checkpoint(LLAMA)


def make_llm(path: str, async_scheduling: bool, **overrides: Any) -> LLM:
    kwargs: dict[str, Any] = {"dtype": "float32", "num_gpu_blocks": NUM_BLOCKS}
    kwargs.update(overrides)
    return LLM(path, async_scheduling=async_scheduling, **kwargs)


@pytest.fixture(scope="module")
def sync_llm(path: str) -> LLM:
    return make_llm(path, False)


@pytest.fixture(scope="module")
def async_llm(path: str) -> LLM:
    return make_llm(path, True)


def prompts(seed: int, count: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [random_ids(g, 3 + (11 * i) % 40) for i in range(count)]


def run(llm: LLM, batch: list[list[int]], params: list[SamplingParams]) -> list[Any]:
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    return [
        [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs
    ]


def greedy(max_tokens: int, **kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def test_greedy_tokens_and_stops_match_sync(sync_llm: LLM, async_llm: LLM) -> None:
    """Different prompt lengths and max_tokens; stop strings and a stop token that end
    requests mid-batch: every token, text and finish reason as without async scheduling."""
    batch = prompts(1, 12)
    plain = run(sync_llm, batch, [greedy(24, ignore_eos=True)] * len(batch))
    params = []
    for i, [(tokens, text, _, _)] in enumerate(plain):
        if i % 3 == 0 and len(text) > 12:  # a stop string from the middle of the output
            params.append(greedy(24, ignore_eos=True, stop=[text[len(text) // 2 :][:3]]))
        elif i % 3 == 1:  # the output's 5th token as a stop token
            params.append(greedy(24, ignore_eos=True, stop_token_ids=[tokens[4]]))
        else:
            params.append(greedy(2 + 3 * i, ignore_eos=i % 2 == 0))
    want = run(sync_llm, batch, params)
    reasons = [r[0][2] for r in want]
    assert reasons.count("stop") >= 6 and "length" in reasons  # ends mid-batch, both ways
    sampled: list[list[tuple[Any, int]]] = []
    engine = async_llm.llm_engine
    record = engine.output_processor.record_samples

    def spy(samples: Any, result: Any, touched: Any) -> None:
        sampled.append(list(samples))
        record(samples, result, touched)

    engine.output_processor.record_samples = spy  # type: ignore[method-assign]
    try:
        assert run(async_llm, batch, params) == want
    finally:
        del engine.output_processor.record_samples
    # Steps were scheduled ahead for requests that had finished: their tokens were dropped.
    assert any(kept == 0 for step in sampled for _, kept in step)
    assert all(r.num_output_placeholders == 0 for step in sampled for r, _ in step)
    # A lone request ending on its stop token leaves a step scheduled behind it, collected
    # before generate returns: an idle engine runs nothing.
    assert run(async_llm, batch[1:2], params[1:2]) == want[1:2]
    assert engine.async_loop.num_in_flight == 0
    assert_pool_clean(engine)


def test_seeded_sampling_matches_sync(sync_llm: LLM, async_llm: LLM) -> None:
    batch = prompts(2, 6)
    params = [
        SamplingParams(temperature=1.0, top_p=0.9, seed=10 + i, max_tokens=4 + 3 * i, n=1 + i % 2)
        for i in range(len(batch))
    ]
    assert run(async_llm, batch, params) == run(sync_llm, batch, params)
    assert_pool_clean(async_llm.llm_engine)


def test_abort_mid_flight(async_llm: LLM, path: str) -> None:
    """An abort while a step of the request is in flight: reported once, nothing after; its
    blocks free; the other requests unaffected."""
    engine = async_llm.llm_engine
    batch = dict(zip("abc", prompts(3, 3), strict=True))
    for rid, prompt in batch.items():
        engine.add_request(rid, prompt, greedy(10, ignore_eos=True))
    outs: dict[str, list[Any]] = {}
    for _ in range(4):
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    assert engine.async_loop.num_in_flight == 1  # b's next step is running
    engine.abort_request("b")
    for step in itertools.count():
        assert step < 100
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            assert not outs[out.request_id][-1].finished, f"{out.request_id} after its end"
            outs.setdefault(out.request_id, []).append(out)
    assert outs["b"][-1].finished and outs["b"][-1].outputs[0].finish_reason == "abort"
    for rid in "ac":
        tokens = [t for o in outs[rid] for t in o.outputs[0].token_ids]
        assert tokens == hf_greedy(path, batch[rid], 10)
        assert outs[rid][-1].outputs[0].finish_reason == "length"
    assert engine.async_loop.num_in_flight == 0  # an idle engine runs nothing
    assert_pool_clean(engine)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preemption_in_a_small_pool(sync_llm: LLM, path: str, policy: str) -> None:
    """8 blocks for 6 requests: preemptions while steps are in flight, the same tokens (under
    "priority" a later, more urgent request also preempts running ones)."""
    llm = make_llm(
        path,
        True,
        num_gpu_blocks=8,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        max_model_len=64,
        scheduling_policy=policy,
    )
    batch = prompts(4, 6)
    params = [greedy(6 + 2 * i, ignore_eos=True) for i in range(len(batch))]
    priority = [len(batch) - i for i in range(len(batch))] if policy == "priority" else None
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in batch], params, use_tqdm=False, priority=priority
    )
    got = [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]
    assert got == run(sync_llm, batch, params)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert_pool_clean(llm.llm_engine)


def test_failed_pass_fails_the_steps_in_flight_and_serves_on(path: str) -> None:
    llm = make_llm(path, True)
    engine = llm.llm_engine
    runner = engine.runner
    real = runner.execute_model
    calls = itertools.count()

    def flaky(sched: Any) -> Any:
        if next(calls) == 2:
            raise RuntimeError("injected failure")
        return real(sched)

    runner.execute_model = flaky  # type: ignore[method-assign]
    try:
        engine.add_request("x", prompts(5, 1)[0], greedy(8, ignore_eos=True))
        finals = []
        for _ in range(30):
            finals += [o for o in engine.step() if o.finished]
            if not engine.has_unfinished_requests():
                break
    finally:
        del runner.execute_model
    assert [o.outputs[0].finish_reason for o in finals] == ["error"]
    assert_pool_clean(engine)
    again = run(llm, prompts(5, 1), [greedy(8, ignore_eos=True)])
    assert again[0][0][0] == hf_greedy(path, prompts(5, 1)[0], 8)


def test_guided_request_refused(async_llm: LLM) -> None:
    params = SamplingParams(max_tokens=4, guided_decoding=GuidedDecodingParams(regex="[ab]+"))
    with pytest.raises(ValueError, match="async_scheduling=True"):
        async_llm.llm_engine.add_request("guided", [5, 6, 7], params)
    assert not async_llm.llm_engine.has_unfinished_requests()


def test_recurrent_state_refused() -> None:
    engine = SimpleNamespace(block_manager=SimpleNamespace(has_recurrent_state=True))
    with pytest.raises(ValueError, match="recurrent state"):
        check_async_engine(engine)
    check_async_engine(SimpleNamespace(block_manager=SimpleNamespace(has_recurrent_state=False)))
