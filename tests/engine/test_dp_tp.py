"""Data parallelism composed with tensor parallelism: `dp * tp` processes, one engine per DP rank
driving its own TP workers, all in one torch.distributed world.

An MoE layer then has `dp * tp` shards of its experts (a slice of every expert's intermediate
dimension, or whole experts with expert parallelism): the DP exchange sums over the DP ranks
that share a TP rank and the TP all-reduce sums over the TP ranks. A wrong group, shard or order
of reductions changes the logits, so transformers' greedy tokens are the check; the one-request
run makes one DP rank (and its TP worker) join every exchange with dummy batches.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.engine._fixtures import checkpoint, hf_greedy, mixed_prompts
from tokenwise import LLM, SamplingParams

MAX_TOKENS = 5
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _tokens(outputs: list[Any]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def _assert_each_rank_drives_one_worker(llm: LLM) -> None:
    """Four processes really run: every DP rank process has started its TP worker."""
    for pid in llm.llm_engine.rank_pids:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(c) for c in f.read().split()]
        names = []
        for child in children:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                names.append(f.read())
        # spawn's children run multiprocessing's entry point; the resource tracker is not one.
        workers = [n for n in names if b"spawn_main" in n and b"resource_tracker" not in n]
        assert len(workers) == 1, names


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_moe_under_dp2_tp2_gives_hf_tokens(expert_parallel: bool) -> None:
    """Qwen2-MoE: routed experts in 4 shards, the shared expert split over TP only."""
    path = checkpoint("Qwen2MoeForCausalLM")
    llm = LLM(path, dtype="float32", data_parallel_size=2, tensor_parallel_size=2,
              enable_expert_parallel=expert_parallel, num_gpu_blocks=64)  # fmt: skip
    try:
        _assert_each_rank_drives_one_worker(llm)
        prompts = mixed_prompts()[:4]
        expected = [hf_greedy(path, p, MAX_TOKENS) for p in prompts]
        assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
        # One request: the other DP rank and its TP worker keep step with dummy batches.
        assert _tokens(llm.generate(prompts[2:3], GREEDY, use_tqdm=False)) == expected[2:3]
        stats = llm.llm_engine.get_rank_stats()
        assert [s.num_free_blocks for s in stats] == [s.num_total_blocks for s in stats]
    finally:
        llm.shutdown()


def test_dense_model_under_dp2_tp2_gives_hf_tokens() -> None:
    """Llama: DP ranks step independently, each with its own TP group."""
    path = checkpoint("LlamaForCausalLM")
    llm = LLM(path, dtype="float32", data_parallel_size=2, tensor_parallel_size=2,
              num_gpu_blocks=64)  # fmt: skip
    try:
        prompts = mixed_prompts()[:4]
        expected = [hf_greedy(path, p, MAX_TOKENS) for p in prompts]
        assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    finally:
        llm.shutdown()
