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
from tests.spec_decode.test_spec_engine import NGRAM, K, with_oracle
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
        logprobs = out.outputs[0].logprobs
        assert logprobs is not None and len(logprobs) == steps
        for step, entry in enumerate(logprobs):
            assert len(entry) >= k  # the top k, plus the sampled token when it is not among them
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
    kv = runner.num_blocks * runner.kv_sizer.kv_cache_bytes_per_block()
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


def test_moe_grouped_matmul_on_cuda_equals_the_loop_and_needs_no_host_sync() -> None:
    """bf16 experts on a Hopper GPU take the grouped-matmul path: the loop's result, and
    capturable in a CUDA graph (a host sync would make capture fail), replaying new inputs."""
    from tokenwise.layers.activation import SiluAndMul
    from tokenwise.layers.fused_moe.experts import fused_experts, grouped_mm_supported

    gen = torch.Generator(device="cuda").manual_seed(0)
    n, e, k, h, inter = 64, 16, 2, 256, 128

    def inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = torch.randn(n, h, device="cuda", generator=gen).bfloat16()
        scores = torch.rand(n, e, device="cuda", generator=gen)
        weights, ids = scores.topk(k, dim=-1)
        return x, weights, ids

    w13 = (0.1 * torch.randn(e, 2 * inter, h, device="cuda", generator=gen)).bfloat16()
    w2 = (0.1 * torch.randn(e, h, inter, device="cuda", generator=gen)).bfloat16()
    act = SiluAndMul()
    x, weights, ids = inputs()
    if not grouped_mm_supported(x):
        pytest.skip("torch._grouped_mm has no bf16 kernel on this GPU (needs sm90+)")

    def run(grouped: bool) -> torch.Tensor:
        return fused_experts(x, w13, w2, weights, ids, act, use_grouped_mm=grouped)

    torch.testing.assert_close(run(True), run(False), atol=2e-2, rtol=0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run(True)  # warm-up outside the capture, as CUDA graphs require
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run(True)
    new_x, new_weights, new_ids = inputs()
    x.copy_(new_x), weights.copy_(new_weights), ids.copy_(new_ids)
    graph.replay()
    torch.testing.assert_close(captured, run(False), atol=2e-2, rtol=0)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_bf16_moe_gets_full_graphs_that_equal_piecewise(arch: str) -> None:
    """With the grouped matmul (bf16, sm90+) an MoE model is graphed like a dense one: decode
    steps replayed whole give the tokens of piecewise graphs (same compiled pieces, with the
    attention and expert ops run eagerly between them)."""
    path = checkpoint(arch)
    prompts = [{"prompt_token_ids": p} for p in mixed_prompts()]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    tokens = {}
    for mode in ("piecewise", None):
        kw = {"cudagraph_mode": "PIECEWISE"} if mode else {}
        llm = LLM(path, dtype="bfloat16", device="cuda", seed=0, num_gpu_blocks=256, **kw)
        resolved = llm.llm_engine.config.compilation.cudagraph_mode.name
        tokens[resolved] = [
            list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)
        ]
        assert_pool_clean(llm.llm_engine)
    assert set(tokens) == {"PIECEWISE", "FULL_AND_PIECEWISE"}  # the default is full graphs
    assert tokens["FULL_AND_PIECEWISE"] == tokens["PIECEWISE"]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_speculative_verify_steps_replay_full_graphs(schedule: str) -> None:
    """N-gram speculation (oracle drafts, every other step one planted wrong draft) under
    FULL_AND_PIECEWISE: uniform verify steps replay FULL graphs over decode rows, output is HF's."""
    path = checkpoint(LLAMA)
    prompts = mixed_prompts()
    refs = [hf_greedy(path, p, MAX_TOKENS) for p in prompts]
    llm = LLM(
        path,
        dtype="float32",
        device="cuda",
        seed=0,
        speculative_config=NGRAM,
        **MODES["full_and_piecewise"],
        **SCHEDULES[schedule],
    )
    with_oracle(llm, prompts, refs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == refs
    stats = llm.llm_engine.get_stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert_pool_clean(llm.llm_engine)
    records, _, _ = llm.llm_engine.step_records.since(0)
    verify = [r.descriptor for r in records if r.graph_mode == "FULL" and r.descriptor]
    assert any(d["uniform"] and d["query_len"] == 1 + K for d in verify)


FP8_CASES = {
    "tensor": ((96, 160), None),
    "channel": ((96, 160), None),
    "block": ((256, 384), (128, 128)),
    "block-partial-tiles": ((384, 320), (128, 128)),
}


@pytest.mark.parametrize("case", FP8_CASES)
def test_fp8_scaled_mm_runs_and_matches_the_definition(case: str) -> None:
    """`FP8Weight.linear` on CUDA goes through `torch._scaled_mm` (no fallback logged) and
    gives the W8A8 definition's result (tests/quantization/test_fp8.py's reference, x per
    token or per token and 128 columns), within bf16 output rounding plus fp32 order. Where
    K is not a multiple of 128 (partial tiles) cuBLAS may refuse the block scales: the layer
    then falls back to its dequantized weight, and must give the weight-only product."""
    from tests.quantization.test_fp8 import _reference_w8a8, quantize_blocks
    from tokenwise.layers.quantization.fp8 import FP8Weight, quantize_fp8

    (n, k), block = FP8_CASES[case]
    gen = torch.Generator().manual_seed(0)
    dense = torch.randn(n, k, generator=gen)
    if block is None:
        weight = quantize_fp8(dense, per_channel=case == "channel")
    else:
        q, s = quantize_blocks(dense, *block)
        weight = FP8Weight(q, s, (n, k), block)
    x = torch.randn(5, k, generator=gen).bfloat16()
    expected = _reference_w8a8(x.float(), weight, None if block is None else block[1])
    on_gpu = FP8Weight(weight.weight.cuda(), weight.scale.cuda(), weight.shape, weight.block)
    ours = on_gpu.linear(x.cuda(), None).float().cpu()
    if getattr(on_gpu, "_no_scaled_mm", False):
        assert case == "block-partial-tiles", "torch._scaled_mm refused the layer"
        expected = x.double() @ weight.dequantize(torch.float64).t()
    scale = expected.abs().max().item()
    torch.testing.assert_close(ours.double(), expected, atol=1e-2 * scale, rtol=0)


def test_fp8_checkpoint_on_cuda_gives_hf_greedy_tokens_on_most_prompts(tmp_path: Any) -> None:
    """A block-FP8 checkpoint on CUDA keeps fp8 layers (W8A8 through `_scaled_mm`); greedy
    tokens equal HF's on the dense float32 weights for at least 4 of 6 prompts (activation
    rounding to e4m3 may flip a close choice)."""
    from tests.quantization.test_fp8 import FULL_TILES, write_fp8
    from tokenwise.layers.quantization.fp8 import FP8_DTYPE, FP8Weight

    fp8, reference = write_fp8(tmp_path, "Qwen3ForCausalLM", FULL_TILES)
    llm = LLM(fp8, dtype="bfloat16", device="cuda", enforce_eager=True, num_gpu_blocks=64)
    model = llm.llm_engine.runner.model
    packed = model.model.layers[0].mlp.down_proj.quant_weight
    assert isinstance(packed, FP8Weight) and packed.weight.dtype == FP8_DTYPE
    assert packed.weight.is_cuda
    prompts = mixed_prompts()[::3]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    same = sum(
        list(o.outputs[0].token_ids) == hf_greedy(reference, p, MAX_TOKENS)
        for o, p in zip(outs, prompts, strict=True)
    )
    assert same >= 4


INT4_KINDS = ["symmetric", "asymmetric", "gptq"]


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("kind", INT4_KINDS)
def test_int4_tinygemm_packing_passes_its_selfcheck_on_cuda(kind: str, group: int) -> None:
    """The CUDA nibble order and tile layout `gpu_int4` assumes are right on this device: the
    self-check takes the kernel (no fallback) and the layer computes the definition within
    bfloat16 (tests/quantization/test_gpu_int4.py checks the same on the CPU twins)."""
    from tests.quantization.test_gpu_int4 import _gptq_like, _relative_error, _weight
    from tokenwise.layers.quantization import gpu_int4, gpu_selfcheck
    from tokenwise.layers.quantization.weight_only import quantize, reference_dequantize

    n, k = 256, 512
    if kind == "gptq":
        weight = _gptq_like(n, k, group)
    else:
        weight = quantize(_weight(n, k), 4, group, symmetric=kind == "symmetric")
    reference = reference_dequantize(weight)
    gpu_selfcheck.move_to(weight, torch.device("cuda"))
    verdicts: dict[Any, Any] = {}
    assert gpu_selfcheck.choose("layer", weight, gpu_int4.CUDA_OPS, verdicts), verdicts
    x = torch.randn(7, k).bfloat16()
    ours = weight.linear(x.cuda(), None).float().cpu()
    assert _relative_error(ours, x.float() @ reference.t()) < 5e-3


@pytest.mark.parametrize("mode", ["eager", "piecewise"])
def test_int4_model_on_cuda_keeps_int4_memory_and_the_cpu_tokens(mode: str) -> None:
    """`quantization="int4"` on CUDA: the layers keep their integers (tinygemm for every layer
    whose shape it takes, none fell back), resident weight bytes ~30% of bf16's, and greedy
    tokens equal the CPU int4 run's (float32) on at least 5 of 6 prompts (bf16 activations
    may flip a close choice)."""
    from tokenwise.layers.quantization.weight_only import QuantizedWeight

    path = checkpoint(LLAMA)
    prompts = mixed_prompts()[::3]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    cpu = LLM(path, quantization="int4", dtype="float32", device="cpu", num_gpu_blocks=64)
    expected = [list(o.outputs[0].token_ids) for o in cpu.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]  # fmt: skip
    llm = LLM(path, quantization="int4", dtype="bfloat16", device="cuda", num_gpu_blocks=64,
              **MODES[mode])  # fmt: skip
    model = llm.llm_engine.runner.model
    held = [m.quant_weight for m in model.modules() if hasattr(m, "quant_weight")]
    quantized = [w for w in held if isinstance(w, QuantizedWeight)]
    assert quantized and all(w.qweight.is_cuda for w in quantized)
    fits = [w for w in quantized if w.shape[0] % 8 == 0]
    assert fits and all(w.device_kernel is not None for w in fits)
    dense_bytes = sum(w.shape[0] * w.shape[1] * 2 for w in quantized)
    assert sum(w.nbytes for w in quantized) <= 0.33 * dense_bytes
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    same = sum(list(o.outputs[0].token_ids) == e for o, e in zip(outs, expected, strict=True))
    assert same >= 5
