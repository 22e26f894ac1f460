"""`SamplingParams.prompt_logprobs` against Hugging Face's log-softmax of the prompt.

The reference is one fp32 transformers forward over each whole prompt: row `t - 1` of its
log-softmax scores prompt token `t`. tokenwise scores the prompt while prefilling it, so the
schedules that split or repeat a prefill (chunks of 8 tokens, a pool small enough to preempt
requests mid-prompt and after it) must give the same values, once per token.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
import torch

from tests.engine._fixtures import (
    LLAMA,
    NUM_BLOCKS,
    assert_pool_clean,
    checkpoint,
    hf_greedy,
    hf_model,
    mixed_prompts,
)
from tokenwise import LLM, SamplingParams

TOL = 1e-4
TOP = 3
# Long enough that the small pool below preempts requests both mid-prompt and after it.
MAX_TOKENS = 20
CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "chunked-8": {"max_num_batched_tokens": 8},
    # 12 blocks of 16: requests are preempted, some in the middle of their prompt's chunks.
    "preempt-chunked-16": {
        "num_gpu_blocks": 12,
        "max_model_len": 192,
        "max_num_batched_tokens": 16,
    },
}


@pytest.fixture(scope="module")
def llama() -> str:
    return checkpoint(LLAMA)


@cache
def hf_prompt_logprobs(path: str, prompt: tuple[int, ...]) -> torch.Tensor:
    """[len(prompt), V]: row i is HF's log-softmax after prompt[: i + 1] (fp32)."""
    with torch.no_grad():
        logits = hf_model(path)(torch.tensor([list(prompt)])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def assert_matches_hf(path: str, prompt: list[int], scored: Any, top: int = TOP) -> None:
    assert scored is not None and len(scored) == len(prompt)
    assert scored[0] is None
    ref = hf_prompt_logprobs(path, tuple(prompt))
    for t in range(1, len(prompt)):
        row, token, entry = ref[t - 1], prompt[t], scored[t]
        want = row[token].item()
        assert entry[token].logprob == pytest.approx(want, abs=TOL), (t, token)
        # Rank: 1 + tokens more likely, up to ties within the tolerance.
        lo = 1 + int((row > want + TOL).sum())
        hi = 1 + int((row > want - TOL).sum())
        assert lo <= entry[token].rank <= hi
        best = row.topk(top).values
        ranked = {lp.rank: (tid, lp.logprob) for tid, lp in entry.items() if tid != token}
        ranked.update({entry[token].rank: (token, want)} if entry[token].rank <= top else {})
        assert sorted(ranked) == list(range(1, top + 1)), entry
        for rank, (tid, value) in ranked.items():
            assert value == pytest.approx(best[rank - 1].item(), abs=TOL)
            assert value == pytest.approx(row[tid].item(), abs=TOL)


def spy_on_preemptions(llm: LLM) -> list[tuple[str, bool]]:
    """Record (request id, preempted before its prompt was all computed) per preemption."""
    scheduler = llm.llm_engine.scheduler
    seen: list[tuple[str, bool]] = []
    preempt = scheduler._preempt

    def recording(req: Any) -> None:
        seen.append((req.request_id, req.num_computed_tokens < req.num_prompt_tokens))
        preempt(req)

    scheduler._preempt = recording
    return seen


@pytest.mark.parametrize("config", list(CONFIGS), ids=list(CONFIGS))
def test_prompt_logprobs_equal_hf_under_every_schedule(llama: str, config: str) -> None:
    prompts = mixed_prompts()
    kwargs: dict[str, Any] = {"num_gpu_blocks": NUM_BLOCKS, **CONFIGS[config]}
    llm = LLM(llama, dtype="float32", seed=0, **kwargs)
    preempted = spy_on_preemptions(llm)
    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=TOP
    )
    inputs = [{"prompt_token_ids": p} for p in prompts]
    outs = llm.generate(inputs, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert_matches_hf(llama, prompt, out.prompt_logprobs)
        assert list(out.outputs[0].token_ids) == hf_greedy(llama, prompt, MAX_TOKENS)
        assert out.outputs[0].logprobs is None  # prompt logprobs only: none for the output
    assert_pool_clean(llm.llm_engine)
    if "num_gpu_blocks" in CONFIGS[config]:
        assert any(mid for _, mid in preempted), "no request was preempted mid-prompt"
        assert any(not mid for _, mid in preempted), "no request was preempted after its prompt"


def test_cached_prefixes_are_recomputed_only_for_requests_that_score_prompts(llama: str) -> None:
    prompts = mixed_prompts()[8:12]  # four prompts sharing a 40-token prefix
    llm = LLM(llama, dtype="float32", num_gpu_blocks=NUM_BLOCKS, seed=0)
    plain = SamplingParams(temperature=0.0, max_tokens=2)
    scored = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(inputs, plain, use_tqdm=False)  # every full prompt block is cached now
    outs = llm.generate(inputs, [scored, plain, scored, plain], use_tqdm=False)
    assert [o.num_cached_tokens > 0 for o in outs] == [False, True, False, True]
    for prompt, out in zip(prompts[::2], outs[::2], strict=True):
        assert_matches_hf(llama, prompt, out.prompt_logprobs, top=0)
        assert all(len(entry) == 1 for entry in out.prompt_logprobs[1:])  # the token alone
    assert outs[1].prompt_logprobs is None and outs[3].prompt_logprobs is None


def test_n_samples_report_the_prompt_once(llama: str) -> None:
    prompt = mixed_prompts()[13]  # 57 tokens: 8 chunks of 8 per sample
    llm = LLM(llama, dtype="float32", num_gpu_blocks=NUM_BLOCKS, max_num_batched_tokens=8)
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=4, prompt_logprobs=1)
    engine = llm.llm_engine
    engine.add_request("r", {"prompt_token_ids": prompt}, params)
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step()
    with_prompt = [d for d in deltas if d.prompt_logprobs is not None]
    assert len(with_prompt) == 1  # in the first delta with a token, and never again
    assert with_prompt[0] is next(d for d in deltas if d.outputs)
    assert_matches_hf(llama, prompt, with_prompt[0].prompt_logprobs, top=1)
    (merged,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert len(merged.outputs) == 3
    assert_matches_hf(llama, prompt, merged.prompt_logprobs, top=1)


def test_tensor_parallel_workers_compute_the_prompt_rows_too(llama: str) -> None:
    """The scored rows travel in the step's logits indices, so TP workers join the same
    vocabulary gather (a mismatch would hang or fail the step)."""
    prompts = mixed_prompts()[:6]
    llm = LLM(
        llama,
        dtype="float32",
        num_gpu_blocks=NUM_BLOCKS,
        tensor_parallel_size=2,
        max_num_batched_tokens=16,
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for prompt, out in zip(prompts, outs, strict=True):
            assert_matches_hf(llama, prompt, out.prompt_logprobs, top=2)
            assert list(out.outputs[0].token_ids) == hf_greedy(llama, prompt, 3)
    finally:
        llm.llm_engine.shutdown()
