"""Recurrent-state layers: a live slot per request, snapshots for prefix hits, rollback.

The toy hybrid (`_toy_recurrent.py`: a tiny Llama whose first layer mixes tokens with a
recurrent state, computed token by token) gives the same state bits however the tokens were
stepped, so each test records the request's live state after every step (keyed by how many
tokens it has computed) and compares runs bit for bit: chunked prefill, preemption and
speculative decoding with rejected drafts must all leave exactly the state a plain run has at
the same position, and a prefix hit must start from exactly the snapshot an earlier request
left.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine._fixtures import assert_pool_clean, checkpoint
from tests.engine._toy_recurrent import toy_hybrid_checkpoint
from tokenwise import LLM, SamplingParams
from tokenwise.engine.block_manager import BlockManager
from tokenwise.kv_cache.managers import ZERO_STATE
from tokenwise.kv_cache.specs import FullAttentionSpec, RecurrentStateSpec
from tokenwise.models.registry import ENV_PLUGINS, resolve_model_class

BS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def toy(tmp_path_factory: pytest.TempPathFactory) -> str:
    return toy_hybrid_checkpoint(
        checkpoint(), Path(tmp_path_factory.mktemp("toy")) / "toy-hybrid", [0]
    )


def make(toy: str, **kwargs: Any) -> LLM:
    return LLM(toy, dtype="float32", block_size=BS, **{"num_gpu_blocks": 64, **kwargs})


def trace(llm: LLM, rid: str, prompt: list[int], params: SamplingParams = GREEDY) -> tuple:
    """Run one request alone; its tokens and {computed tokens: live state} after each step."""
    engine = llm.llm_engine
    bm = engine.block_manager
    group = next(m.group_id for m in bm.managers if m.spec.kind == "recurrent")
    mixer = engine.runner.recurrent.layers[0]
    engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    req = engine.groups[rid][0]
    states: dict[int, torch.Tensor] = {}
    while engine.has_unfinished_requests():
        engine.step()
        if req in engine.scheduler.running:
            slot = bm.get_block_table(req.request_id, group)[0]
            states[req.num_computed_tokens] = mixer.kv_cache[0][slot].clone()
    assert_pool_clean(engine)
    return list(req.output_token_ids), states


def same_bits(a: dict, b: dict) -> int:
    """Positions both traces recorded; each must hold the same bits."""
    common = sorted(a.keys() & b.keys())
    for n in common:
        assert torch.equal(a[n], b[n]), f"states differ after {n} tokens"
    return len(common)


PROMPT = list(range(5, 75))  # 70 tokens: four full blocks and a tail
# Repeats itself, so n-gram drafts are proposed (and some rejected).
REPETITIVE = [11, 12, 13, 14, 15, 16, 17, 18] * 6


def test_chunked_prefill_and_preemption_leave_the_same_state(toy: str) -> None:
    plain_tokens, plain = trace(make(toy), "a", PROMPT)
    chunked_tokens, chunked = trace(make(toy, max_num_batched_tokens=24), "a", PROMPT)
    assert chunked_tokens == plain_tokens
    assert same_bits(plain, chunked) >= 20
    # Prefill chunks of 24 end on block boundaries (16, 32, ...): snapshots can be taken.
    assert {16, 32, 48, 64} <= chunked.keys()


def test_preemption_resumes_with_the_same_state(toy: str) -> None:
    """Two requests in a pool for one and a half: the later one is preempted, recomputes from
    a snapshot or from zeros, and ends with the plain run's tokens and states."""
    _, plain_a = trace(make(toy), "a", PROMPT)
    llm = make(toy, num_gpu_blocks=9, max_model_len=96, max_num_batched_tokens=32)
    engine = llm.llm_engine
    prompts = [PROMPT, PROMPT[::-1]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert engine.scheduler.num_preemptions > 0
    for p, out in zip(prompts, outs, strict=True):
        alone, _ = trace(make(toy), "x", p)
        assert list(out.outputs[0].token_ids) == alone
    assert_pool_clean(engine)
    assert plain_a  # (the states of the plain run are compared in the prefix-hit test)


def test_prefix_hit_resumes_from_the_snapshot(toy: str) -> None:
    llm = make(toy)
    first_tokens, first = trace(llm, "a", PROMPT)
    engine = llm.llm_engine
    hits_before = engine.get_stats().prefix_cache_hits
    second_tokens, second = trace(llm, "b", PROMPT)
    assert engine.get_stats().prefix_cache_hits - hits_before == 64  # four blocks
    assert second_tokens == first_tokens
    # The second request resumed at 64 tokens from the first one's snapshot: every state it
    # went through is the first request's, to the bit.
    assert min(second) > 64
    assert same_bits(first, second) == len(second)
    cold_tokens, _ = trace(make(toy), "c", PROMPT)
    assert second_tokens == cold_tokens


def test_speculative_rollback_restores_the_state(toy: str) -> None:
    """n-gram drafts, most rejected, some accepted: after every verification the state is
    exactly the plain run's after the tokens kept."""
    params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    plain_tokens, plain = trace(make(toy, num_gpu_blocks=32), "a", REPETITIVE, params)
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    llm = make(toy, num_gpu_blocks=32, speculative_config=spec)
    spec_tokens, spec_states = trace(llm, "a", REPETITIVE, params)
    assert spec_tokens == plain_tokens
    stats = llm.llm_engine.get_stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert same_bits(plain, spec_states) >= 60


def test_pool_too_small_for_one_state_is_a_startup_error(toy: str) -> None:
    with pytest.raises(ValueError, match="recurrent state"):
        LLM(toy, dtype="float32", kv_cache_memory=512)


# ------------------------------------------------------------------------ the manager


def manager(slots: int = 4) -> BlockManager:
    specs = [FullAttentionSpec(BS, 64, ()), RecurrentStateSpec(BS, 256, ())]
    return BlockManager(32, BS, specs=specs, num_state_slots=slots)


def test_snapshots_are_published_only_once_the_step_ran() -> None:
    bm = manager()
    prompt = list(range(40))
    assert bm.allocate_slots("a", prompt, 0, 32) == ([0, 1], [0])  # live slot 0
    step = bm.take_state_step("a")
    assert step is not None and step.init == ZERO_STATE and step.snapshot == 1
    # Not yet visible: the runner has not written it.
    assert bm.get_computed_blocks("b", prompt)[1] == 0
    bm.check_invariants()
    bm.commit_step()
    hits, num_hit = bm.get_computed_blocks("b", prompt)
    assert num_hit == 32 and hits[1] == [1]
    assert bm.allocate_slots("b", prompt, 0, 8, hits) is not None
    step = bm.take_state_step("b")
    assert step is not None and step.init == 1  # starts from the snapshot
    bm.check_invariants()
    bm.commit_step()
    bm.free("a")
    bm.free("b")
    assert bm.num_free_state_slots == 4 and bm.get_num_free_blocks() == 32
    bm.check_invariants()


def test_a_step_that_never_ran_leaves_no_snapshot() -> None:
    bm = manager()
    prompt = list(range(40))
    assert bm.allocate_slots("a", prompt, 0, 16) is not None
    bm.discard_step()  # the forward pass failed
    assert bm.get_computed_blocks("b", prompt)[1] == 0
    bm.free("a")
    bm.free("b")
    assert bm.num_free_state_slots == 4
    bm.check_invariants()


def test_no_free_slot_means_no_admission_and_no_snapshot() -> None:
    bm = manager(slots=1)
    assert bm.allocate_slots("a", list(range(40)), 0, 16) is not None
    assert bm.take_state_step("a").snapshot is None  # type: ignore[union-attr]
    assert bm.allocate_slots("b", list(range(100, 140)), 0, 16) is None  # no live slot left
    bm.free("a")
    assert bm.allocate_slots("b", list(range(100, 140)), 0, 16) is not None
    bm.free("b")
    bm.check_invariants()


def test_tensor_parallel_keeps_every_shard_in_step(
    toy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TP=2: each rank holds half of every state; the step message carries the state plan
    and the driver broadcasts the rollbacks, so tokens equal one process's, with prefix hits
    and rejected drafts along the way. (The spawned workers load the toy as a plugin.)"""
    monkeypatch.setenv(ENV_PLUGINS, "tests.engine._toy_recurrent")
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    # Two batches: the second prompt's prefix hits the snapshots the first batch left (a
    # snapshot is published once its step has run, so a batch cannot hit its own).
    batches = [[REPETITIVE, PROMPT], [REPETITIVE + [5]]]

    def run(llm: LLM) -> list[list[int]]:
        return [
            list(o.outputs[0].token_ids)
            for batch in batches
            for o in llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        ]

    one = make(toy, num_gpu_blocks=48, speculative_config=spec)
    want = run(one)
    del one
    two = make(toy, num_gpu_blocks=48, speculative_config=spec, tensor_parallel_size=2)
    try:
        assert run(two) == want
        stats = two.llm_engine.get_stats()
        assert stats.prefix_cache_hits > 0
        assert stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
        assert_pool_clean(two.llm_engine)
    finally:
        two.shutdown()


def test_pipeline_stages_keep_each_virtual_engine_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PP=2 over a four-layer toy with a recurrent layer on each stage: every virtual engine
    has its own copy of each state, the driver plans with that engine's slots and each stage
    does its own layers' copies, so chunked prefills and prefix hits (on both engines) give
    one process's tokens."""
    monkeypatch.setenv(ENV_PLUGINS, "tests.engine._toy_recurrent")
    toy4 = toy_hybrid_checkpoint(checkpoint(num_hidden_layers=4), tmp_path / "toy4", [0, 2])
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    batches = [[REPETITIVE, PROMPT, PROMPT[:40]], [REPETITIVE + [5], PROMPT + [9, 9]]]

    def run(llm: LLM) -> list[list[int]]:
        return [
            list(o.outputs[0].token_ids)
            for batch in batches
            for o in llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        ]

    settings = {"num_gpu_blocks": 96, "max_num_batched_tokens": 32}
    one = make(toy4, **settings)
    want = run(one)
    del one
    two = make(toy4, **settings, pipeline_parallel_size=2)
    try:
        assert run(two) == want
        engine = two.llm_engine
        assert engine.get_stats().prefix_cache_hits > 0
        mixer = engine.runner.recurrent.layers[0]
        assert len(mixer.kv_cache) == 2 and mixer.kv_cache[0] is not mixer.kv_cache[1]
        assert all(copy.abs().sum() > 0 for copy in mixer.kv_cache)  # both engines ran
        assert_pool_clean(engine)
    finally:
        two.shutdown()


def test_a_plugin_that_does_not_import_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_PLUGINS, "tests.engine.no_such_plugin")
    with pytest.raises(ValueError, match=r"TOKENWISE_PLUGINS names module 'tests.engine.no_"):
        resolve_model_class(["NoSuchForCausalLM"])
