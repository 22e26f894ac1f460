"""Suffix decoding through the whole engine: greedy output unchanged, sampled output keeps its
distribution, and finished requests' outputs feed later requests' drafts."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest

from tests.engine._fixtures import LLAMA, NUM_BLOCKS, assert_pool_clean, checkpoint, mixed_prompts
from tokenwise import LLM, SamplingParams

SUFFIX = {"method": "suffix", "num_speculative_tokens": 6, "disable_by_batch_size": 1000}


@pytest.fixture(scope="module")
def llama() -> str:
    return checkpoint(LLAMA)


def make_llm(path: str, spec: dict[str, Any] | None) -> LLM:
    return LLM(path, speculative_config=spec, dtype="float32", num_gpu_blocks=NUM_BLOCKS, seed=0)


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_greedy_output_equals_decoding_without_drafts(llama: str) -> None:
    # Mixed prompts, and prompts that repeat a passage so that drafts are proposed at once.
    prompts = mixed_prompts()[:8] + [p[:20] * 3 for p in mixed_prompts()[8:12] if len(p) >= 20]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ref = run(make_llm(llama, None), prompts, params)
    llm = make_llm(llama, SUFFIX)
    assert run(llm, prompts, params) == ref
    assert run(llm, prompts, params) == ref  # again, with the first run's outputs cached
    stats = llm.llm_engine.get_stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    # Finished requests leave no per-request state behind; their outputs are in the cache.
    drafter = llm.llm_engine.drafter
    assert drafter is not None
    assert (drafter.suffix.num_tracked, len(drafter.budget)) == (0, 0)
    assert len(drafter.suffix._cached) == 2 * len(prompts)  # both runs, under the bound
    assert_pool_clean(llm.llm_engine)


def homogeneity(a: Counter, b: Counter) -> tuple[float, int]:
    """Pearson's two-sample chi-square statistic over outcomes seen at least 10 times in
    all (rarer ones pooled), and its degrees of freedom."""
    na, nb = sum(a.values()), sum(b.values())
    keys = [k for k in a.keys() | b.keys() if a[k] + b[k] >= 10]
    rows = [(a[k], b[k]) for k in keys]
    rows.append((na - sum(r[0] for r in rows), nb - sum(r[1] for r in rows)))
    stat = 0.0
    for x, y in rows:
        total = x + y
        if total == 0:
            continue
        ex, ey = total * na / (na + nb), total * nb / (na + nb)
        stat += (x - ex) ** 2 / ex + (y - ey) ** 2 / ey
    return stat, len(rows) - 1


def test_sampled_outputs_keep_their_distribution(llama: str) -> None:
    """Many samples of one prompt, with and without suffix decoding: the cache of earlier
    outputs makes later requests draft (and have some drafts rejected) at every position;
    the outputs' frequencies must agree (two-sample chi-square at the 0.1% level)."""
    prompt = mixed_prompts()[5]
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=4, ignore_eos=True)
    samples: list[Counter] = []
    for spec in (None, SUFFIX):
        llm = make_llm(llama, spec)
        counts: Counter = Counter()
        for _ in range(8):
            counts.update(tuple(t) for t in run(llm, [prompt] * 50, params))
        samples.append(counts)
        if spec is not None:
            stats = llm.llm_engine.get_stats()
            assert stats.spec_decode_num_draft_tokens > 300
            assert (
                0.2
                < stats.spec_decode_num_accepted_tokens / stats.spec_decode_num_draft_tokens
                < 0.95
            )
    stat, df = homogeneity(*samples)
    a = 2.0 / (9.0 * df)
    critical = df * (1.0 - a + 3.09 * math.sqrt(a)) ** 3  # Wilson-Hilferty, upper 0.1%
    assert df >= 3 and stat < critical, (stat, df, samples)
