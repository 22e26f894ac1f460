"""Draft-model speculation through the whole engine: exact output, and a right draft KV cache.

Two drafts built here with the target's tokenizer: the target itself (every greedy draft must
then be accepted, which fails at once if the draft's KV cache, positions or catch-up are off by
anything), and a copy of the target with noise on one layer's matrices (about half its drafts
accepted: accepted drafts, rejected ones whose draft K/V is overwritten, and the target's
rollback all happen). A random draft of another seed and size is accepted almost never, which
still checks that verification keeps the output.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from functools import cache
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.engine._fixtures import (
    LLAMA,
    NUM_BLOCKS,
    assert_pool_clean,
    checkpoint,
    hf_greedy,
    mixed_prompts,
)
from tests.spec_decode.test_rejection import chi2_critical
from tokenwise import LLM, GuidedDecodingParams, SamplingParams
from tokenwise.sampling import rejection

MAX_TOKENS = 12
K = 3
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
PARITY_SETTINGS = [
    {},
    {"max_num_batched_tokens": 8},
    {"num_gpu_blocks": 12, "max_model_len": 192},
    {"num_gpu_blocks": 12, "max_model_len": 192, "max_num_batched_tokens": 16},
    {"max_num_seqs": 1},
]
PARITY_IDS = ["default", "chunked-8", "preempt", "preempt-chunked-16", "max-num-seqs-1"]


@cache
def noisy_draft(scale: float = 0.1) -> str:
    """The target's checkpoint with Gaussian noise (`scale` x each matrix's std) on the
    matrices of its last layer: a draft that agrees with the target about half the time."""
    path = os.path.join(tempfile.mkdtemp(dir=os.path.dirname(checkpoint(LLAMA))), "draft")
    shutil.copytree(checkpoint(LLAMA), path)
    weights = load_file(os.path.join(path, "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    for name, w in weights.items():
        if ".layers.1." in name and w.dim() == 2:
            weights[name] = w + scale * w.std() * torch.randn(w.shape, generator=gen)
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


def make_llm(draft: str | None, k: int = K, disable: int | None = 64, **overrides: Any) -> LLM:
    kwargs: dict[str, Any] = {"dtype": "float32", "num_gpu_blocks": NUM_BLOCKS, "seed": 0}
    kwargs.update(overrides)
    spec = None
    if draft is not None:
        spec = {"model": draft, "num_speculative_tokens": k, "disable_by_batch_size": disable}
    return LLM(checkpoint(LLAMA), speculative_config=spec, **kwargs)


def generate(llm: LLM, prompts: list[list[int]], params: Any) -> list[Any]:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def tokens(outputs: list[Any]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def hf_refs() -> list[list[int]]:
    return [hf_greedy(checkpoint(LLAMA), p, MAX_TOKENS) for p in mixed_prompts()]


@pytest.mark.parametrize("config", PARITY_SETTINGS, ids=PARITY_IDS)
def test_greedy_with_a_draft_model_equals_hf(
    hf_refs: list[list[int]], config: dict[str, Any]
) -> None:
    prompts = mixed_prompts()
    llm = make_llm(noisy_draft(), **config)
    assert tokens(generate(llm, prompts, GREEDY)) == hf_refs
    stats = llm.llm_engine.get_stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert stats.generation_tokens_total == len(prompts) * MAX_TOKENS
    assert_pool_clean(llm.llm_engine)
    if not config:  # again: every prompt's blocks are prefix-cache hits the draft never wrote
        assert tokens(generate(llm, prompts, GREEDY)) == hf_refs
        assert llm.llm_engine.get_stats().prefix_cache_hits > 0
        assert_pool_clean(llm.llm_engine)


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"num_gpu_blocks": 48, "max_model_len": 192},
        {"num_gpu_blocks": 32, "max_model_len": 128, "max_num_batched_tokens": 16},
    ],
    ids=["default", "preempt", "preempt-chunked-16"],
)
def test_the_target_as_its_own_draft_is_always_accepted(
    hf_refs: list[list[int]], config: dict[str, Any]
) -> None:
    """Greedy drafts of the target itself are the target's greedy tokens, so every one must
    be accepted: a draft cache written at the wrong slots, a wrong position, a catch-up that
    skips or repeats a token, all show as rejections here. Block size 4 with 6 drafts puts
    look-ahead positions two blocks past the allocated ones (scratch blocks); 16-token passes
    split the catch-up of long prompts."""
    prompts = mixed_prompts()
    llm = make_llm(checkpoint(LLAMA), k=6, block_size=4, **config)
    drafter = llm.llm_engine.drafter
    assert drafter is not None and drafter.draft_model is not None
    runner = drafter.draft_model.runner
    passes: list[int] = []
    run = runner.run
    runner.run = lambda seqs: (passes.append(sum(len(s.tokens) for s in seqs)), run(seqs))[1]
    assert tokens(generate(llm, prompts, GREEDY)) == hf_refs
    stats = llm.llm_engine.get_stats()
    assert stats.spec_decode_num_draft_tokens > 3 * len(prompts)
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
    if config:
        assert stats.num_preemptions_total > 0  # restarted requests caught up from scratch
    else:
        # Each known token runs through the draft once, and each fed draft once: the catch-up
        # starts where the draft's cache stops being right, not at the start of the sequence.
        known = sum(map(len, prompts)) + len(prompts) * MAX_TOKENS
        fed = stats.spec_decode_num_draft_tokens - stats.spec_decode_num_drafts
        assert sum(passes) <= known + fed
    assert_pool_clean(llm.llm_engine)


def test_a_random_draft_of_another_size_changes_nothing(hf_refs: list[list[int]]) -> None:
    draft = checkpoint(LLAMA, seed=1, num_hidden_layers=1, hidden_size=32, intermediate_size=64)
    llm = make_llm(draft, max_num_batched_tokens=16)
    assert tokens(generate(llm, mixed_prompts(), GREEDY)) == hf_refs
    assert llm.llm_engine.get_stats().spec_decode_num_drafts > 0
    assert_pool_clean(llm.llm_engine)


def test_the_drafts_kv_group_is_sized_in_the_same_budget() -> None:
    """A draft model's K/V (a block beside each target block, plus its scratch blocks) comes
    out of `kv_cache_memory`, not on top of it: the target gets fewer blocks than alone, and
    every cache tensor of both models together fills the budget (to a block)."""
    budget = 2 * 2**20
    draft = checkpoint(LLAMA, seed=1, num_hidden_layers=1, hidden_size=32, intermediate_size=64)
    alone = LLM(checkpoint(LLAMA), dtype="float32", kv_cache_memory=budget)
    target_bytes = alone.llm_engine.runner.kv_sizer.kv_cache_bytes_per_block()
    blocks_alone = alone.llm_engine.model_executor.num_blocks
    del alone
    spec = {"model": draft, "num_speculative_tokens": K}
    llm = LLM(checkpoint(LLAMA), dtype="float32", kv_cache_memory=budget, speculative_config=spec)
    engine = llm.llm_engine
    blocks = engine.model_executor.num_blocks
    draft_caches = engine.drafter.draft_model.runner.kv_caches.values()
    used = sum(t.numel() * t.element_size() for t in engine.runner.kv_caches.values())
    used += sum(t.numel() * t.element_size() for t in draft_caches)
    draft_bytes = engine.runner.kv_sizer.extra_bytes_per_block
    assert blocks < blocks_alone
    # Each cache tensor has one spare block row past the pool's (the backend's pad block).
    assert budget - target_bytes - draft_bytes < used <= budget + target_bytes + draft_bytes
    assert all(t.shape[1] > blocks for t in draft_caches)  # the shared blocks, then scratch


def test_n_samples_and_a_guided_request_keep_their_output() -> None:
    prompts = mixed_prompts()[:3]
    guided = SamplingParams(
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        guided_decoding=GuidedDecodingParams(regex="(ab|cd|x[0-9])+"),
    )
    n3 = SamplingParams(n=3, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    params = [n3, guided, n3]
    ref = generate(make_llm(None), prompts, params)
    llm = make_llm(noisy_draft())
    outs = generate(llm, prompts, params)
    for got, want in zip(outs, ref, strict=True):
        assert [list(c.token_ids) for c in got.outputs] == [list(c.token_ids) for c in want.outputs]
    assert outs[1].outputs[0].text == ref[1].outputs[0].text
    assert llm.llm_engine.get_stats().spec_decode_num_accepted_tokens > 0
    assert_pool_clean(llm.llm_engine)


def _samples(llm: LLM, n: int) -> list[tuple[int, ...]]:
    """`n` samples of 3 tokens at temperature 0.5 after one prompt: the first is drawn at the
    prefill, the second verifies a draft, the third is drawn after it (or is the bonus)."""
    prompt = mixed_prompts()[1]
    params = SamplingParams(temperature=0.5, max_tokens=3, ignore_eos=True)
    return [tuple(t) for t in tokens(generate(llm, [prompt] * n, params))]


def _homogeneity(a: list[Any], b: list[Any]) -> tuple[float, float]:
    """Two-sample chi-square of equal-size samples (cells under 10 pooled), and the 0.1%
    critical value."""
    keys = set(a) | set(b)
    ca = {x: a.count(x) for x in keys}
    cb = {x: b.count(x) for x in keys}
    small = [x for x in keys if ca[x] + cb[x] < 10]
    cells = [(ca[x], cb[x]) for x in keys if x not in small]
    cells.append((sum(ca[x] for x in small), sum(cb[x] for x in small)))
    cells = [(u, v) for u, v in cells if u + v]
    stat = sum((u - v) ** 2 / (u + v) for u, v in cells)
    return stat, chi2_critical(len(cells) - 1)


def test_sampled_outputs_keep_the_target_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    """1500 samples with greedy drafts verified against 1500 without drafts: the joint
    distribution of the first two tokens and each later token's marginal agree (chi-square at
    0.1%); and the same test fails when the residual drawn from after a rejection keeps the
    draft's mass (q is one-hot at the greedy draft: the residual must drop that token)."""
    torch.manual_seed(0)
    ref = _samples(make_llm(None), 1500)
    llm = make_llm(noisy_draft(), disable=None, max_num_seqs=256)
    got = _samples(llm, 1500)
    stats = llm.llm_engine.get_stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    for key in (lambda t: t[:2], lambda t: t[1], lambda t: t[2]):
        stat, critical = _homogeneity([key(t) for t in ref], [key(t) for t in got])
        assert stat < critical, (stat, critical)
    assert_pool_clean(llm.llm_engine)
    monkeypatch.setattr(rejection, "_residual", lambda probs, *_: probs.clone())
    bad = _samples(llm, 1500)
    stat, critical = _homogeneity([t[:2] for t in ref], [t[:2] for t in bad])
    assert stat > critical


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"model": "/no/such/draft", "num_speculative_tokens": 2}, "model must be a checkpoint"),
        ({"model": "SELF", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
        ({"model": "VOCAB", "num_speculative_tokens": 2}, "vocab_size 320, but the target's"),
        ({"model": "SHORT", "num_speculative_tokens": 2}, "speculative_config.model .*max_model"),
    ],
    ids=["missing-dir", "k-0", "vocab", "too-short"],
)
def test_bad_draft_configs_name_the_field(spec: dict[str, Any], message: str) -> None:
    drafts = {
        "SELF": checkpoint(LLAMA),
        "VOCAB": checkpoint(LLAMA, vocab_size=320),
        "SHORT": checkpoint(LLAMA, max_position_embeddings=64),
    }
    spec = {**spec, "model": drafts.get(spec["model"], spec["model"])}
    with pytest.raises(ValueError, match=message):
        LLM(checkpoint(LLAMA), dtype="float32", num_gpu_blocks=32, speculative_config=spec)


def test_tensor_parallel_with_a_draft_model_is_refused_before_any_worker_starts() -> None:
    spec = {"model": checkpoint(LLAMA), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        LLM(checkpoint(LLAMA), tensor_parallel_size=2, speculative_config=spec)


def test_data_parallel_ranks_each_run_their_own_draft(hf_refs: list[list[int]]) -> None:
    """Each DP rank's engine core loads its own draft (its forward passes are local: no DP
    collective) and accepts every draft of the target itself."""
    prompts = mixed_prompts()[:6]
    spec = {"model": checkpoint(LLAMA), "num_speculative_tokens": K}
    llm = LLM(checkpoint(LLAMA), dtype="float32", data_parallel_size=2, speculative_config=spec)
    try:
        assert tokens(generate(llm, prompts, GREEDY)) == hf_refs[:6]
        per_rank = llm.llm_engine.get_rank_stats()
        assert all(s.spec_decode_num_drafts > 0 for s in per_rank)
        total = llm.llm_engine.get_stats()
        assert total.spec_decode_num_accepted_tokens == total.spec_decode_num_draft_tokens > 0
        assert total.num_free_blocks == total.num_total_blocks
    finally:
        llm.shutdown()


def test_a_greedy_draft_is_a_one_hot_proposal_to_verification() -> None:
    """Verification without draft probabilities (what the draft model passes) decides exactly
    as with the one-hot distribution of a greedy draft: same acceptances, same residual draws."""
    from tokenwise.sampling.metadata import SamplingMetadata, make_generator

    vocab, drafts = 7, [[3, 1], [0, 5, 2]]
    logits = torch.randn(7, vocab, generator=torch.Generator().manual_seed(3))  # 2+1, 3+1 rows
    one_hot = torch.nn.functional.one_hot(torch.tensor([3, 1, 0, 5, 2]), vocab).float()
    outs = []
    for probs in (None, one_hot):
        params = [SamplingParams(temperature=1.0, seed=11)] * 7
        gens = [make_generator(11 + i) for i in range(7)]
        metadata = SamplingMetadata.from_params(params, gens, vocab_size=vocab)
        outs.append(
            [rejection.verify(logits, drafts, metadata, probs).token_ids for _ in range(20)]
        )
    assert outs[0] == outs[1]
    assert any(len(t[0]) < 3 for t in outs[0])  # rejections, so residual draws, happened
