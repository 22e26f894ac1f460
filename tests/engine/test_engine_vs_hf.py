"""End-to-end correctness: tokenwise's greedy tokens and logprobs equal Hugging Face's.

The reference is transformers' `generate(do_sample=False)` run on one unpadded prompt at a time
(no attention mask, no batching), so any difference comes from tokenwise's paged KV cache,
batching, chunked prefill, preemption/recompute or prefix caching. Every scheduling
configuration must give the same tokens, and leave the block pool exactly as it found it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.engine._fixtures import (
    BLOCK_SIZE,
    LLAMA,
    NUM_BLOCKS,
    assert_pool_clean,
    checkpoint,
    hf_greedy,
    hf_step_logprobs,
    mixed_prompts,
)
from tokenwise import LLM, SamplingParams

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

# name -> LLM kwargs on top of fp32 and a NUM_BLOCKS pool.
CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    # Every prompt longer than 8 tokens is prefilled in chunks, mixed with other decodes.
    "chunked-8": {"max_num_batched_tokens": 8},
    "chunked-8-no-prefix-cache": {"max_num_batched_tokens": 8, "enable_prefix_caching": False},
    # 12 blocks of 16 tokens: the longest request (95 + 10 tokens) needs 7, so only a couple
    # of requests fit at once and decodes that need a new block preempt others. The pool
    # holds exactly one sequence of max_model_len (the engine refuses to start with less).
    "preempt": {"num_gpu_blocks": 12, "max_model_len": 192},
    "preempt-chunked-16": {
        "num_gpu_blocks": 12,
        "max_model_len": 192,
        "max_num_batched_tokens": 16,
    },
    "no-prefix-cache": {"enable_prefix_caching": False},
    "max-num-seqs-1": {"max_num_seqs": 1},
    "max-num-seqs-64": {"max_num_seqs": 64},
    "block-size-4": {"block_size": 4, "num_gpu_blocks": 4 * NUM_BLOCKS},
}


@pytest.fixture(scope="module")
def llama() -> str:
    return checkpoint(LLAMA)


@pytest.fixture(scope="module")
def hf_refs(llama: str) -> list[list[int]]:
    return [hf_greedy(llama, p, MAX_TOKENS) for p in mixed_prompts()]


def make_llm(path: str, **overrides: Any) -> LLM:
    kwargs: dict[str, Any] = {"dtype": "float32", "num_gpu_blocks": NUM_BLOCKS, "seed": 0}
    kwargs.update(overrides)
    return LLM(path, **kwargs)


def spy_on_schedule(engine: Any) -> list[list[tuple[int, bool]]]:
    """Record every step's (num_new_tokens, completes_sequence) per scheduled request."""
    steps: list[list[tuple[int, bool]]] = []
    schedule = engine.scheduler.schedule

    def recording_schedule() -> Any:
        out = schedule()
        if not out.is_empty:
            steps.append([(s.num_new_tokens, s.completes_sequence) for s in out.scheduled])
        return out

    engine.scheduler.schedule = recording_schedule
    return steps


def token_ids(outputs: list[Any]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("config", list(CONFIGS), ids=list(CONFIGS))
def test_greedy_matches_hf_under_every_schedule(
    config: str, llama: str, hf_refs: list[list[int]]
) -> None:
    overrides = CONFIGS[config]
    llm = make_llm(llama, **overrides)
    engine = llm.llm_engine
    prompts = mixed_prompts()
    caching = overrides.get("enable_prefix_caching", True)
    steps = spy_on_schedule(engine)
    # Twice on one engine: the second pass finds the first pass's blocks in the prefix cache.
    for attempt in range(2):
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.prompt_token_ids for o in outputs] == prompts
        for i, (got, want) in enumerate(zip(token_ids(outputs), hf_refs, strict=True)):
            assert got == want, f"prompt {i} ({len(prompts[i])} tokens), pass {attempt}"
        for o in outputs:
            assert o.finished
            assert o.outputs[0].finish_reason == "length"
        assert_pool_clean(engine)
        if attempt == 1 and caching:
            assert sum(o.num_cached_tokens for o in outputs) > 0
    if not caching:
        assert engine.block_manager.prefix_cache_hits == 0
        assert all(o.num_cached_tokens == 0 for o in outputs)
    if "num_gpu_blocks" in overrides and overrides.get("block_size") is None:
        assert engine.scheduler.num_preemptions > 0, "the small pool should force preemption"
        assert engine.get_stats().num_preemptions_total == engine.scheduler.num_preemptions
    budget = overrides.get("max_num_batched_tokens", 2048)
    max_seqs = overrides.get("max_num_seqs", 128)
    assert all(sum(n for n, _ in step) <= budget for step in steps)
    assert all(len(step) <= max_seqs for step in steps)
    if max_seqs == 1:
        assert max(len(step) for step in steps) == 1
    else:
        assert max(len(step) for step in steps) > 1  # requests really were batched
    partial_prefills = sum(1 for step in steps for n, done in step if n > 1 and not done)
    if "max_num_batched_tokens" in overrides:
        assert partial_prefills > 0, "a small token budget should chunk prompts"
    elif "num_gpu_blocks" not in overrides:
        assert partial_prefills == 0  # 2048 tokens fit every prompt at once


# ------------------------------------------------------------------ other architectures

ARCH_PROMPTS = [0, 1, 3, 4, 6, 9, 12, 13, 15]  # indexes into mixed_prompts(): 1..95 tokens
ARCHS: dict[str, dict[str, Any]] = {
    # A window smaller than almost every prompt, so most attention is truncated.
    "MistralForCausalLM": {"sliding_window": 8},
    "Qwen2ForCausalLM": {},  # q/k/v biases
    "Qwen3ForCausalLM": {},  # q/k norms, explicit head_dim
}


@pytest.mark.parametrize("schedule", ["default", "chunked-8"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_other_architectures_match_hf(arch: str, schedule: str) -> None:
    path = checkpoint(arch, **ARCHS[arch])
    prompts = [mixed_prompts()[i] for i in ARCH_PROMPTS]
    refs = [hf_greedy(path, p, MAX_TOKENS) for p in prompts]
    llm = make_llm(path, **CONFIGS[schedule])
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for i, (got, want) in enumerate(zip(token_ids(outputs), refs, strict=True)):
        assert got == want, f"{arch}: prompt of {len(prompts[i])} tokens"
    assert_pool_clean(llm.llm_engine)


def test_sliding_window_changes_the_reference() -> None:
    """Guards the Mistral case above: with the window off, HF's own continuations differ (the
    weights are identical: they depend only on the seed), so matching HF proves tokenwise
    applies the window rather than attending to everything."""
    windowed = checkpoint("MistralForCausalLM", sliding_window=8)
    full = checkpoint("MistralForCausalLM")
    prompts = [mixed_prompts()[i] for i in ARCH_PROMPTS]
    differ = [hf_greedy(windowed, p, MAX_TOKENS) != hf_greedy(full, p, MAX_TOKENS) for p in prompts]
    assert any(differ)
    # Prompts within the window cannot tell the difference on their first token at least.
    short = [p for p in prompts if len(p) <= 8]
    for p in short:
        assert hf_greedy(windowed, p, 1) == hf_greedy(full, p, 1)


# ------------------------------------------------------------------------ logprobs


def test_logprobs_match_hf_log_softmax(llama: str) -> None:
    """Top-5 logprobs of the first three tokens, for a batch mixing 1- to 95-token prompts
    (the first step is the prompt's last position, the next two are decodes), equal
    log_softmax of HF's raw logits."""
    steps, k = 3, 5
    llm = make_llm(llama)
    prompts = mixed_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, logprobs=k)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for i, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
        ref = hf_step_logprobs(llama, prompt, steps)
        completion = out.outputs[0]
        assert completion.logprobs is not None and len(completion.logprobs) == steps
        expected_cumulative = 0.0
        for step, (entry, token) in enumerate(
            zip(completion.logprobs, completion.token_ids, strict=True)
        ):
            top = torch.topk(ref[step], k)
            top_ids = top.indices.tolist()
            where = f"prompt {i}, step {step}"
            assert token == top_ids[0], where  # greedy
            # The sampled token is the top-1 here, so the entry is exactly the top-k.
            assert sorted(entry) == sorted(top_ids), where
            top_values = top.values.tolist()
            for rank, (tid, value) in enumerate(zip(top_ids, top_values, strict=True), start=1):
                assert entry[tid].rank == rank, where
                assert entry[tid].logprob == pytest.approx(value, abs=1e-4), where
                assert entry[tid].decoded_token is not None
            expected_cumulative += ref[step][token].item()
        assert completion.cumulative_logprob == pytest.approx(expected_cumulative, abs=1e-3)
    assert_pool_clean(llm.llm_engine)


def test_prefix_cached_prompt_gives_hf_logprobs(llama: str, hf_refs: list[list[int]]) -> None:
    """A prompt whose first blocks come from the prefix cache (another request computed them)
    still gets HF's logits: the cached KV is the right KV."""
    llm = make_llm(llama)
    prompts = mixed_prompts()
    shared = [p for p in prompts if len(p) > 40 and p[:40] == prompts[10]]
    assert len(shared) == 3
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    llm.generate(prompts[10], params, use_tqdm=False)  # caches the 40-token prefix (2 blocks)
    outputs = llm.generate(shared, params, use_tqdm=False)
    for prompt, out in zip(shared, outputs, strict=True):
        assert out.num_cached_tokens == 2 * BLOCK_SIZE
        ref = hf_step_logprobs(llama, prompt, 1)[0]
        for tid, value in out.outputs[0].logprobs[0].items():
            assert value.logprob == pytest.approx(ref[tid].item(), abs=1e-4)
    assert_pool_clean(llm.llm_engine)


@pytest.mark.parametrize("arch", [LLAMA, "Qwen3ForCausalLM"])
def test_packed_prefill_gives_hf_tokens(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU's one-call prefill, forced on CPU: chunked prompts, prefix-cache hits (a
    second pass) and preemption all give HF's greedy tokens."""
    from tokenwise.attention.backends.torch_backend import TorchAttentionImpl

    monkeypatch.setattr(TorchAttentionImpl, "_prefill", TorchAttentionImpl._prefill_packed)
    path = checkpoint(arch)
    refs = [hf_greedy(path, p, MAX_TOKENS) for p in mixed_prompts()]
    llm = make_llm(path, max_num_batched_tokens=16, num_gpu_blocks=12, max_model_len=192)
    for _ in range(2):
        outputs = llm.generate(mixed_prompts(), GREEDY, use_tqdm=False)
        assert token_ids(outputs) == refs
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert_pool_clean(llm.llm_engine)
