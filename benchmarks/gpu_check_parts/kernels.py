"""Quantized linear kernels and the fp8 KV cache on the device.

Each quantization method: greedy tokens of a tiny Llama through the engine equal HF's greedy
tokens on the checkpoint's dequantized weights (the reference the CPU suite uses, from
tests/quantization): exactly in fp32 (the layers dequantize per call), and mostly in bf16,
where the GPU kernels run (their own rounding). Then a one-row timing of one decoder-sized
linear layer (K = N = 4096 on a GPU) against the dense bf16 matmul: the batch-1 decode case,
where the bytes of the weight decide.
On a CUDA device fp8 runs W8A8 through `torch._scaled_mm` and int4 through tinygemm (packed
and self-checked as the loader does); in a dry run the same calls take the CPU routes (the C
fp8 GEMV, tinygemm's CPU twins), so the code runs and only the figures are meaningless.
"""

from __future__ import annotations

import pathlib
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.gpu_check_parts.plan import Context, Part


def _greedy_equal(ctx: Context, label: str, model: str, reference: str, **kwargs: Any) -> None:
    from tests.engine._fixtures import hf_greedy, mixed_prompts
    from tokenwise import LLM, SamplingParams

    steps = ctx.size(4, 8)
    prompts = [{"prompt_token_ids": p} for p in mixed_prompts()[: ctx.size(3, 18)]]
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    runs = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(model, dtype=dtype, device=ctx.device, enforce_eager=True, num_gpu_blocks=64,
                  max_num_batched_tokens=16, **kwargs)  # fmt: skip
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs[dtype] = [list(o.outputs[0].token_ids) for o in outs]
        del llm
    want = [hf_greedy(reference, p["prompt_token_ids"], steps) for p in prompts]
    same = sum(g == w for g, w in zip(runs["float32"], want, strict=True))
    ctx.figure(f"{label}_greedy_equal_dequantized", same, "requests", same == len(prompts),
               of=len(prompts))  # fmt: skip
    # bf16 is where the GPU kernels run (tinygemm, W8A8 `_scaled_mm`); their rounding is not
    # the reference's, so agreement is reported, ok when most requests agree.
    same = sum(g == w for g, w in zip(runs["bfloat16"], want, strict=True))
    ctx.figure(f"{label}_bf16_greedy_equal_dequantized", same, "requests",
               2 * same >= len(prompts), of=len(prompts))  # fmt: skip


def time_call(ctx: Context, fn: Callable[[], Any]) -> float:
    """Median microseconds of one call, over bursts (synchronised on CUDA)."""
    sync = torch.cuda.synchronize if ctx.device == "cuda" else (lambda: None)
    for _ in range(3):
        fn()
    sync()
    burst, samples = ctx.size(2, 50), []
    for _ in range(ctx.size(3, 20)):
        start = time.perf_counter()
        for _ in range(burst):
            fn()
        sync()
        samples.append((time.perf_counter() - start) / burst * 1e6)
    return round(statistics.median(samples), 2)


def one_row_timings(ctx: Context) -> None:
    from tokenwise.layers.quantization import gpu_int4, gpu_selfcheck
    from tokenwise.layers.quantization.fp8 import FP8Weight, quantize_fp8
    from tokenwise.layers.quantization.weight_only import quantize

    k = n = ctx.size(256, 4096)
    dev = torch.device(ctx.device)
    dense = torch.randn(n, k, generator=torch.Generator().manual_seed(ctx.seed)) * 0.02
    x = torch.randn(1, k, dtype=torch.bfloat16).to(dev)
    w16 = dense.to(torch.bfloat16).to(dev)
    base = time_call(ctx, lambda: F.linear(x, w16))
    ctx.figure("dense_bf16_1row", base, "us", shape=[n, k])
    q = quantize_fp8(dense)
    fp8 = FP8Weight(q.weight.to(dev), q.scale.to(dev), q.shape)
    spent = time_call(ctx, lambda: fp8.linear(x, None))
    ctx.figure("fp8_1row", spent, "us", speedup=round(base / spent, 2), shape=[n, k])
    ops = gpu_int4.CUDA_OPS if ctx.device == "cuda" else gpu_int4.CPU_TWIN_OPS
    for label, symmetric in (("int4_sym", True), ("int4_zero_point", False)):
        weight = quantize(dense, 4, 128, symmetric)
        gpu_selfcheck.move_to(weight, dev)
        picked = gpu_selfcheck.choose(label, weight, ops, {})  # packs and self-checks
        call = weight.device_kernel.mm if picked else partial(weight.linear, bias=None)
        spent = time_call(ctx, partial(call, x))
        ctx.figure(f"{label}_1row", spent, "us", picked, speedup=round(base / spent, 2),
                   route=ops.name if picked else "dequantize per call", shape=[n, k])  # fmt: skip


def quant_kernels(ctx: Context) -> None:
    from tests.quantization import test_fp8, test_gptq_awq, test_quantized_engine

    tmp = pathlib.Path(ctx.workdir)
    path = test_quantized_engine._checkpoint(tmp / "int4")
    scheme = test_quantized_engine.SCHEMES["int4"]
    reference = test_quantized_engine._dequantized_copy(path, str(tmp / "int4-ref"), *scheme)
    _greedy_equal(ctx, "int4", path, reference, quantization="int4", max_model_len=128)
    fp8, reference = test_fp8.write_fp8(tmp / "fp8", "LlamaForCausalLM", test_fp8.FULL_TILES)
    _greedy_equal(ctx, "fp8_block", fp8, reference)
    gptq, reference, _ = test_gptq_awq._checkpoints(tmp / "gptq", "gptq", act_order=True,
                                                    fmt="gptq_v2")  # fmt: skip
    _greedy_equal(ctx, "gptq_act_order", gptq, reference)
    one_row_timings(ctx)


def kv_cache_fp8(ctx: Context) -> None:
    """fp8 KV against the model dtype's: greedy agreement (not lossless: reported, ok when at
    least half the requests agree on a decisive tiny model) and one-stream decode speed."""
    from tests.engine._fixtures import mixed_prompts
    from tests.tiny_checkpoints import build_tiny_checkpoint
    from tokenwise import LLM, SamplingParams

    path = build_tiny_checkpoint(ctx.workdir, "LlamaForCausalLM")
    prompts = [{"prompt_token_ids": p} for p in mixed_prompts()[: ctx.size(3, 18)]]
    params = SamplingParams(temperature=0.0, max_tokens=ctx.size(4, 64), ignore_eos=True)
    runs = {}
    for kv in ("auto", "fp8"):
        llm = LLM(path, dtype=ctx.size("float32", "bfloat16"), device=ctx.device,
                  kv_cache_dtype=kv, num_gpu_blocks=256, enforce_eager=True)  # fmt: skip
        llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outs = llm.generate(prompts[:1], params, use_tqdm=False)
        rate = len(outs[0].outputs[0].token_ids) / (time.perf_counter() - start)
        runs[kv] = [
            list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)
        ]
        ctx.figure(f"decode_one_stream_{kv}", round(rate, 1), "tok/s", kv_cache_dtype=kv)
        del llm
    same = sum(a == b for a, b in zip(runs["auto"], runs["fp8"], strict=True))
    ctx.figure("fp8_greedy_equal_auto", same, "requests", 2 * same >= len(prompts),
               of=len(prompts))  # fmt: skip


PARTS = [
    Part("quant_kernels", 120, quant_kernels, "int4 / fp8 / GPTQ tokens and one-row timings"),
    Part("kv_cache_fp8", 60, kv_cache_fp8, "fp8 KV cache: agreement and decode speed"),
]
