"""Speculative decoding through the whole engine: greedy output is unchanged, drafts roll back.

Random tiny models rarely repeat themselves, so most tests swap the n-gram proposer for an
oracle that knows the reference continuation (Hugging Face greedy, or the engine without
speculation) and plants a wrong draft on every other step: accepted drafts, rejected ones and
the rollback of their KV slots all happen, under every scheduling setting of the parity tests.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.engine._fixtures import (
    LLAMA,
    NUM_BLOCKS,
    assert_pool_clean,
    checkpoint,
    hf_greedy,
    mixed_prompts,
)
from tokenwise import LLM, GuidedDecodingParams, SamplingParams

MAX_TOKENS = 12
K = 3
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "disable_by_batch_size": 64}
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


class Oracle:
    """Drafts the known continuation of each prompt; by default every other step's second
    draft is wrong."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], vocab: int) -> None:
        self.continuations = continuations
        self.vocab = vocab
        self.calls = 0
        self.plant = "alternate"  # or "all" (every draft wrong) or "none" (every draft right)

    def propose(self, tokens: np.ndarray, max_tokens: int | None = None) -> list[int]:
        seq = tokens.tolist()
        k = K if max_tokens is None else min(K, max_tokens)
        for prompt, cont in self.continuations.items():
            done = len(seq) - len(prompt)
            if (
                done >= 0
                and seq[: len(prompt)] == list(prompt)
                and seq[len(prompt) :] == cont[:done]
            ):
                drafts = list(cont[done : done + k])
                self.calls += 1
                if self.plant == "all":
                    return [(t + 1) % self.vocab for t in drafts]
                if self.plant == "alternate" and self.calls % 2 and len(drafts) > 1:
                    drafts[1] = (drafts[1] + 1) % self.vocab
                return drafts
        return []


def make_llm(path: str, spec: dict[str, Any] | None = NGRAM, **overrides: Any) -> LLM:
    kwargs: dict[str, Any] = {"dtype": "float32", "num_gpu_blocks": NUM_BLOCKS, "seed": 0}
    kwargs.update(overrides)
    return LLM(path, speculative_config=spec, **kwargs)


def with_oracle(llm: LLM, prompts: list[list[int]], refs: list[list[int]]) -> Oracle:
    drafter = llm.llm_engine.drafter
    assert drafter is not None
    oracle = Oracle({tuple(p): r for p, r in zip(prompts, refs, strict=True)}, 256)
    drafter.proposer = oracle  # type: ignore[assignment]
    return oracle


def tokens(outputs: list[Any]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def llama() -> str:
    return checkpoint(LLAMA)


@pytest.fixture(scope="module")
def hf_refs(llama: str) -> list[list[int]]:
    return [hf_greedy(llama, p, MAX_TOKENS) for p in mixed_prompts()]


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"max_num_batched_tokens": 8},
        {"num_gpu_blocks": 12, "max_model_len": 192},
        {"num_gpu_blocks": 12, "max_model_len": 192, "max_num_batched_tokens": 16},
        {"max_num_seqs": 1},
    ],
    ids=["default", "chunked-8", "preempt", "preempt-chunked-16", "max-num-seqs-1"],
)
def test_greedy_equals_hf_with_drafts_accepted_and_rejected(
    llama: str, hf_refs: list[list[int]], config: dict[str, Any]
) -> None:
    prompts = mixed_prompts()
    llm = make_llm(llama, **config)
    with_oracle(llm, prompts, hf_refs)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert tokens(outs) == hf_refs
    stats = llm.llm_engine.get_stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    # Every step is one token plus the accepted drafts: fewer steps than tokens.
    assert stats.generation_tokens_total == len(prompts) * MAX_TOKENS
    assert_pool_clean(llm.llm_engine)
    if not config:  # again, now every prompt's blocks come from the prefix cache
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        assert tokens(outs) == hf_refs
        assert llm.llm_engine.get_stats().prefix_cache_hits > 0
        assert_pool_clean(llm.llm_engine)


def test_ngram_proposer_keeps_greedy_output(llama: str, hf_refs: list[list[int]]) -> None:
    prompts = mixed_prompts()
    llm = make_llm(llama, max_num_batched_tokens=16)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert tokens(outs) == hf_refs
    assert llm.llm_engine.get_stats().spec_decode_num_drafts > 0
    assert_pool_clean(llm.llm_engine)


def _reference(path: str, prompts: list[list[int]], params: SamplingParams) -> list[Any]:
    return make_llm(path, spec=None).generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
    )


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2),
        SamplingParams(
            temperature=0.0, max_tokens=MAX_TOKENS, repetition_penalty=1.3, presence_penalty=0.5
        ),
    ],
    ids=["logprobs", "penalties"],
)
def test_logprobs_and_penalties_match_decoding_without_drafts(
    llama: str, params: SamplingParams
) -> None:
    prompts = mixed_prompts()[:6]
    ref = _reference(llama, prompts, params)
    llm = make_llm(llama)
    with_oracle(llm, prompts, tokens(ref))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert tokens(outs) == tokens(ref)
    assert llm.llm_engine.get_stats().spec_decode_num_accepted_tokens > 0
    if params.logprobs:
        for got, want in zip(outs, ref, strict=True):
            for g, w in zip(got.outputs[0].logprobs, want.outputs[0].logprobs, strict=True):
                assert g.keys() == w.keys()
                for tid in g:
                    assert g[tid].logprob == pytest.approx(w[tid].logprob, abs=1e-5)
                    assert g[tid].rank == w[tid].rank


def test_a_stop_inside_accepted_drafts_ends_the_request_there(
    llama: str, hf_refs: list[list[int]]
) -> None:
    prompts = mixed_prompts()[:6]
    # Stop on a token each reference emits in its middle: the oracle drafts past it.
    stops = [ref[5] for ref in hf_refs[:6]]
    params = [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[s]) for s in stops
    ]
    ref = make_llm(llama, spec=None).generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
    )
    llm = make_llm(llama)
    with_oracle(llm, prompts, hf_refs[:6])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert tokens(outs) == tokens(ref)
    assert [o.outputs[0].text for o in outs] == [o.outputs[0].text for o in ref]
    for out, stop in zip(outs, stops, strict=True):
        assert out.outputs[0].token_ids[-1] == stop
        assert out.outputs[0].finish_reason == "stop"
    assert_pool_clean(llm.llm_engine)


def test_guided_and_lora_requests_in_a_speculative_batch(llama: str) -> None:
    from tests.lora.test_lora_vs_peft import request

    prompts = mixed_prompts()[:4]
    guided = SamplingParams(
        temperature=0.0, max_tokens=8, guided_decoding=GuidedDecodingParams(regex="(ab|cd)+")
    )
    params = [GREEDY, guided, GREEDY, GREEDY]
    loras = [None, None, request(LLAMA, "all-r8"), None]
    kwargs = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8}

    def run(llm: LLM) -> list[Any]:
        inputs = [{"prompt_token_ids": p} for p in prompts]
        return llm.generate(inputs, params, use_tqdm=False, lora_request=loras)

    ref = run(make_llm(llama, spec=None, **kwargs))
    llm = make_llm(llama, **kwargs)
    with_oracle(llm, prompts, tokens(ref))
    outs = run(llm)
    assert tokens(outs) == tokens(ref)
    assert outs[1].outputs[0].text == ref[1].outputs[0].text
    assert llm.llm_engine.get_stats().spec_decode_num_accepted_tokens > 0
    assert_pool_clean(llm.llm_engine)


def test_no_drafts_from_the_batch_size_threshold_on(llama: str) -> None:
    prompts = mixed_prompts()[:3]  # all three run together until they finish
    inputs = [{"prompt_token_ids": p} for p in prompts]
    off = make_llm(llama, spec={**NGRAM, "disable_by_batch_size": 3})
    on = make_llm(llama, spec={**NGRAM, "disable_by_batch_size": 4})
    refs = [hf_greedy(llama, p, MAX_TOKENS) for p in prompts]
    for llm in (off, on):
        with_oracle(llm, prompts, refs)
        assert tokens(llm.generate(inputs, GREEDY, use_tqdm=False)) == refs
    assert off.llm_engine.get_stats().spec_decode_num_drafts == 0
    assert on.llm_engine.get_stats().spec_decode_num_drafts > 0


def test_seeded_sampling_with_drafts_is_reproducible(llama: str) -> None:
    prompts = mixed_prompts()[:4]
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=123, max_tokens=MAX_TOKENS)
    greedy_refs = [hf_greedy(llama, p, MAX_TOKENS) for p in prompts]
    runs = []
    for _ in range(2):
        llm = make_llm(llama)
        with_oracle(llm, prompts, greedy_refs)
        runs.append(
            tokens(llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
        )
        assert_pool_clean(llm.llm_engine)
    assert runs[0] == runs[1]
    assert all(len(t) == MAX_TOKENS for t in runs[0])


def test_speculation_is_refused_for_models_it_cannot_serve() -> None:
    with pytest.raises(ValueError, match="speculative_config applies to text-only decoder"):
        make_llm(checkpoint("BertModel"), task="embed")


def test_tensor_parallel_verification_equals_hf(llama: str, hf_refs: list[list[int]]) -> None:
    """The TP workers run the verification rows too (the step's logits indices travel)."""
    prompts = mixed_prompts()[:6]
    llm = make_llm(llama, tensor_parallel_size=2, max_num_batched_tokens=16)
    try:
        with_oracle(llm, prompts, hf_refs[:6])
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        assert tokens(outs) == hf_refs[:6]
        assert llm.llm_engine.get_stats().spec_decode_num_accepted_tokens > 0
    finally:
        llm.llm_engine.shutdown()


def test_n_samples_each_verify_their_own_drafts(llama: str, hf_refs: list[list[int]]) -> None:
    prompts = mixed_prompts()[:3]
    params = SamplingParams(n=3, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm = make_llm(llama)
    with_oracle(llm, prompts, hf_refs[:3])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, ref in zip(outs, hf_refs[:3], strict=True):
        assert [list(c.token_ids) for c in out.outputs] == [ref] * 3
    assert llm.llm_engine.get_stats().spec_decode_num_accepted_tokens > 0
    assert_pool_clean(llm.llm_engine)


def test_requests_whose_drafts_keep_failing_back_off(llama: str) -> None:
    """Always-wrong drafts: a few probing steps, then none for a while (those steps would only
    cost more than plain decoding); always-right drafts keep going."""
    prompt = mixed_prompts()[0]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ref = hf_greedy(llama, prompt, 40)
    counts = []
    for mode in ("all", "none"):
        llm = make_llm(llama)
        oracle = with_oracle(llm, [prompt], [ref])
        oracle.plant = mode
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        assert tokens(out) == [ref]
        counts.append(llm.llm_engine.get_stats().spec_decode_num_drafts)
    # Without the back-off, every one of the ~39 decode steps would draft.
    assert counts[0] <= 12
    assert counts[1] >= 8  # ~4 tokens per step, every step drafting


@pytest.mark.parametrize(
    "guide",
    [
        GuidedDecodingParams(regex="(ab|cd|x[0-9])+"),
        GuidedDecodingParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}),
    ],
    ids=["regex", "json"],
)
def test_guided_requests_verify_masked_drafts(llama: str, guide: GuidedDecodingParams) -> None:
    """Drafts of guided requests are masked per position (the planted wrong drafts are often
    outside the grammar): the output is the guided output without drafts, and drafts held."""
    prompts = mixed_prompts()[:4]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, guided_decoding=guide)
    ref = _reference(llama, prompts, params)
    llm = make_llm(llama)
    with_oracle(llm, prompts, tokens(ref))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert tokens(outs) == tokens(ref)
    assert [o.outputs[0].text for o in outs] == [o.outputs[0].text for o in ref]
    stats = llm.llm_engine.get_stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert_pool_clean(llm.llm_engine)


def test_data_parallel_cores_speculate_and_report_their_drafts(
    llama: str, hf_refs: list[list[int]]
) -> None:
    """Each DP rank's engine core runs its own drafter; the client sums their figures."""
    prompts = mixed_prompts()[:6]
    llm = LLM(llama, dtype="float32", data_parallel_size=2, speculative_config=NGRAM)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        assert tokens(outs) == hf_refs[:6]
        per_rank = llm.llm_engine.get_rank_stats()
        total = llm.llm_engine.get_stats()
        assert total.spec_decode_num_drafts == sum(s.spec_decode_num_drafts for s in per_rank)
        assert total.spec_decode_num_drafts > 0
        assert total.num_free_blocks == total.num_total_blocks
    finally:
        llm.shutdown()
