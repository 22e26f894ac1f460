"""The GPU path on a real CUDA device: every graph mode gives HF's tokens and logprobs.

Skipped where there is no CUDA device (CI has none); run on a GPU machine with
`python -m pytest tests/test_gpu_path.py` (and `TRITON_INTERPRET=0 python -m pytest
tests/attention/test_triton_kernel.py` for the compiled Triton kernel). The CPU suite covers the
same logic with a fake graph capturer; these tests are what shows that capture, replay,
piecewise compilation and the Triton decode kernel behave the same on the hardware.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.engine._fixtures import (
    LLAMA,
    assert_pool_clean,
    checkpoint,
    hf_greedy,
    hf_step_logprobs,
    mixed_prompts,
)
from tokenwise import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MAX_TOKENS = 10
MODES: dict[str, dict[str, Any]] = {
    "eager": {"enforce_eager": True},
    "piecewise": {"enforce_eager": False, "cudagraph_mode": "PIECEWISE"},
    "full_and_piecewise": {"enforce_eager": False, "cudagraph_mode": "FULL_AND_PIECEWISE"},
}
# Scheduling that changes which graph sizes run: chunked prefills mixed with decodes, and a
# pool small enough that decodes preempt others and recompute them.
SCHEDULES: dict[str, dict[str, Any]] = {
    "default": {"num_gpu_blocks": 256},
    "chunked-preempt": {"num_gpu_blocks": 12, "max_model_len": 192, "max_num_batched_tokens": 16},
}


@pytest.fixture(scope="module", params=[LLAMA, "Qwen3ForCausalLM"])
def model_and_refs(request: pytest.FixtureRequest) -> tuple[str, list[list[int]]]:
    path = checkpoint(request.param)
    return path, [hf_greedy(path, p, MAX_TOKENS) for p in mixed_prompts()]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("mode", MODES)
def test_greedy_tokens_equal_hf_in_every_graph_mode(
    model_and_refs: tuple[str, list[list[int]]], mode: str, schedule: str
) -> None:
    path, refs = model_and_refs
    llm = LLM(path, dtype="float32", device="cuda", seed=0, **MODES[mode], **SCHEDULES[schedule])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in mixed_prompts()]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == refs
    assert_pool_clean(llm.llm_engine)


@pytest.mark.parametrize("mode", ["eager", "full_and_piecewise"])
def test_logprobs_equal_hf_log_softmax(model_and_refs: tuple[str, list[list[int]]], mode: str):
    path, _ = model_and_refs
    llm = LLM(path, dtype="float32", device="cuda", num_gpu_blocks=256, **MODES[mode])
    steps, k = 3, 5
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, logprobs=k)
    prompts = mixed_prompts()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        ref = hf_step_logprobs(path, prompt, steps)
        for step, entry in enumerate(out.outputs[0].logprobs or []):
            for tid, value in entry.items():
                assert value.logprob == pytest.approx(ref[step][tid].item(), abs=1e-4)


def test_profiled_kv_cache_keeps_the_process_within_gpu_memory_utilization(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The pool sized from the profile leaves the whole process under its share of the GPU."""
    caplog.set_level("INFO", logger="tokenwise")
    from benchmarks.gpu_check import QWEN
    from tokenwise.benchmarks.common import make_workload

    utilization = 0.3
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    llm = LLM(QWEN, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
              max_model_len=2048, gpu_memory_utilization=utilization, device="cuda")  # fmt: skip
    work = make_workload(64, (100, 1024), (16, 64), 151936, seed=0)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in work]
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in work]
    llm.generate(prompts, params, use_tqdm=False)
    free, total = torch.cuda.mem_get_info()
    non_torch = total - free - torch.cuda.memory_reserved()
    peak = torch.cuda.max_memory_reserved() + non_torch
    report = [m for r in caplog.records if "memory" in (m := r.getMessage()) or "KV" in m]
    report += [f"non-torch {non_torch / 2**30:.2f} GiB at the end"]
    assert peak <= utilization * total, (peak / 2**30, utilization * total / 2**30, report)
    # ... and the budget was used: the KV cache alone is most of it for a 0.6B model.
    runner = llm.llm_engine.runner
    kv = runner.num_blocks * runner.kv_cache_bytes_per_block()
    assert kv >= 0.5 * utilization * total


MOE_ARCHS = ["Qwen2MoeForCausalLM", "MixtralForCausalLM"]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("mode", ["eager", "piecewise"])
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_greedy_tokens_equal_hf(arch: str, mode: str, schedule: str) -> None:
    """MoE layers on CUDA (router, grouped experts behind the opaque op, Qwen2-MoE's gated
    shared expert): HF's tokens eagerly and with the graph cut at the expert op."""
    path = checkpoint(arch)
    refs = [hf_greedy(path, p, MAX_TOKENS) for p in mixed_prompts()]
    llm = LLM(path, dtype="float32", device="cuda", seed=0, **MODES[mode], **SCHEDULES[schedule])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in mixed_prompts()], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == refs
    assert_pool_clean(llm.llm_engine)
