"""MoE models under data (and expert) parallelism: ranks that step together.

An MoE layer under DP exchanges tokens between ranks every forward pass, so every rank must run
the same passes: a rank without requests runs dummy batches, and when no rank has work none
runs. Each configuration must give transformers' greedy tokens: the experts are sharded over
the ranks (a slice of every expert, or whole experts with expert parallelism), so a wrong
gather, combine or shard would change the logits.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.engine._fixtures import checkpoint, hf_greedy, mixed_prompts
from tokenwise import LLM, SamplingParams

MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
MOE_ARCHS = ["MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"]


def _tokens(outputs: list[Any]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture
def dp_llm(request: pytest.FixtureRequest) -> Iterator[Any]:
    """`dp_llm(arch, **kwargs)` builds a DP engine that is shut down after the test."""
    made: list[LLM] = []

    def make(arch: str, **kwargs: Any) -> tuple[LLM, str]:
        path = checkpoint(arch)
        llm = LLM(path, dtype="float32", data_parallel_size=2, **kwargs)
        made.append(llm)
        return llm, path

    yield make
    for llm in made:
        llm.shutdown()


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_dp2_gives_hf_tokens_and_an_idle_rank_keeps_step(arch: str, dp_llm: Any) -> None:
    llm, path = dp_llm(arch)
    prompts = mixed_prompts()[:4]
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == [
        hf_greedy(path, p, MAX_TOKENS) for p in prompts
    ]
    # One request: one rank has nothing to do and must still join every MoE exchange, with a
    # dummy pass for each of the other rank's MAX_TOKENS steps (without them it would hang).
    before = llm.llm_engine.get_rank_stats()
    out = llm.generate(prompts[1:2], GREEDY, use_tqdm=False)
    assert _tokens(out) == [hf_greedy(path, prompts[1], MAX_TOKENS)]
    after = llm.llm_engine.get_rank_stats()
    generated = [
        a.generation_tokens_total - b.generation_tokens_total
        for a, b in zip(after, before, strict=True)
    ]
    assert sorted(generated) == [0, MAX_TOKENS]
    idle = generated.index(0)
    # A rank reports its stats when it steps: one request more for each makes the idle rank
    # report the dummy passes it ran meanwhile.
    assert _tokens(llm.generate(prompts[:2], GREEDY, use_tqdm=False)) == [
        hf_greedy(path, p, MAX_TOKENS) for p in prompts[:2]
    ]
    after = llm.llm_engine.get_rank_stats()
    dummies = [
        a.num_dummy_steps_total - b.num_dummy_steps_total
        for a, b in zip(after, before, strict=True)
    ]
    assert dummies[idle] >= MAX_TOKENS, dummies
    stats = llm.llm_engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_expert_parallel_with_chunked_exchange_and_chunked_prefill(
    dp_llm: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 3 tokens per rank per exchange: every prefill chunk (up to 16 tokens) takes several.
    monkeypatch.setenv("TOKENWISE_MOE_DP_CHUNK_SIZE", "3")
    llm, path = dp_llm(
        "Qwen3MoeForCausalLM", enable_expert_parallel=True, max_num_batched_tokens=16
    )
    prompts = mixed_prompts()[:5]
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == [
        hf_greedy(path, p, MAX_TOKENS) for p in prompts
    ]


def test_microbatching_gives_hf_tokens(dp_llm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # Forward times per batch size are collected by every rank (and logged by each).
    monkeypatch.setenv("TOKENWISE_LOG_BATCHSIZE_INTERVAL", "1000")
    llm, path = dp_llm(
        "MixtralForCausalLM",
        enable_microbatching=True,
        microbatching_token_threshold=2,
        enable_expert_parallel=True,
    )
    prompts = mixed_prompts()[:6]
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == [
        hf_greedy(path, p, MAX_TOKENS) for p in prompts
    ]
    stats = llm.llm_engine.get_stats()
    assert stats.num_ubatched_steps_total > 0  # the split really ran
    assert stats.num_ubatched_steps_total <= stats.num_steps_total
    tables = llm.llm_engine.batchsize_stats
    assert len(tables) == 2 and all(tables), tables  # one table per rank, both filled
    for table in tables:
        assert all(count > 1 and median_ms > 0 for _, count, median_ms in table)


def test_preemption_under_dp(dp_llm: Any) -> None:
    # 8 blocks of 16 per rank (one 128-token sequence), chunked prefill admitting several
    # requests at once: decodes that need a new block preempt others on each rank.
    llm, path = dp_llm(
        "Qwen2MoeForCausalLM", num_gpu_blocks=8, max_model_len=128, max_num_batched_tokens=16
    )
    prompts = mixed_prompts()
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == [
        hf_greedy(path, p, MAX_TOKENS) for p in prompts
    ]
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions_total > 0
    assert stats.num_free_blocks == stats.num_total_blocks
