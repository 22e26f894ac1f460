"""Graph modes and throughput: eager / PIECEWISE / FULL_AND_PIECEWISE agree; the nano-vllm
workload next to transformers' continuous batching; where a step's time goes.

In a dry run (CPU) the graph modes are the CPU's own: eager, FULL_DECODE_ONLY and FULL are
recordings of the C kernels (`tokenwise.compilation.cpu_graph`), the CPU equivalent of CUDA
graphs (piecewise graphs need a CUDA device); each figure names the mode that actually ran.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any

from benchmarks.gpu_check_parts.plan import Context, Part

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN = os.path.join(HERE, "configs", "qwen3-0.6b")
# (mode on CUDA, its CPU stand-in in a dry run), as LLM keyword arguments.
MODES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "eager": ({"enforce_eager": True}, {"enforce_eager": True}),
    "piecewise": (
        {"enforce_eager": False, "cudagraph_mode": "PIECEWISE"},
        {"enforce_eager": None, "cudagraph_mode": "FULL_DECODE_ONLY"},
    ),
    "full_and_piecewise": (
        {"enforce_eager": False, "cudagraph_mode": "FULL_AND_PIECEWISE"},
        {"enforce_eager": None, "cudagraph_mode": "FULL"},
    ),
}


def mode_kwargs(ctx: Context, mode: str) -> dict[str, Any]:
    cuda, cpu = MODES[mode]
    return cpu if ctx.dry_run else cuda


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (None when equal)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def graph_modes(ctx: Context) -> None:
    """Greedy tokens of the tiny fp32 Qwen3 in each mode must equal eager's exactly."""
    from tests.tiny_checkpoints import build_tiny_checkpoint
    from tokenwise import LLM, SamplingParams

    path = build_tiny_checkpoint(ctx.workdir, "Qwen3ForCausalLM")
    n = ctx.size(3, 12)
    prompts = [f"Request {i}: the quick brown fox" for i in range(n)]
    params = [
        SamplingParams(temperature=0, max_tokens=4 + 2 * i, ignore_eos=True) for i in range(n)
    ]
    reference = None
    for mode in MODES:
        kwargs = mode_kwargs(ctx, mode)
        start = time.perf_counter()
        llm = LLM(path, dtype="float32", device=ctx.device, seed=ctx.seed, num_gpu_blocks=256,
                  max_num_seqs=ctx.size(4, 16), **kwargs)  # fmt: skip
        built = time.perf_counter() - start
        outs = llm.generate(prompts, params, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        reference = reference or tokens
        divs = [first_divergence(a, b) for a, b in zip(tokens, reference, strict=True)]
        same = sum(d is None for d in divs)
        ran = kwargs.get("cudagraph_mode", "NONE")
        ctx.figure(f"{mode}_equal_eager", same, "requests", same == n, of=n, ran_as=ran,
                   first_divergence=min((d for d in divs if d is not None), default=None),
                   engine_start_s=round(built, 2))  # fmt: skip
        del llm
        release()


def release() -> None:
    """Free the previous engine's memory (compiled code holds the model until a reset)."""
    import gc

    import torch

    gc.collect()
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def workload_model(ctx: Context) -> tuple[str, list[str]]:
    """The model and its flags: the Qwen3-0.6B shape in bf16 on a GPU, the tiny one dry."""
    if ctx.dry_run:
        from tests.tiny_checkpoints import build_tiny_checkpoint

        return build_tiny_checkpoint(ctx.workdir, "Qwen3ForCausalLM"), ["--dtype", "float32"]
    return QWEN, ["--load-format", "dummy", "--dtype", "bfloat16"]


def throughput(ctx: Context) -> None:
    """`tokenwise bench throughput` on the nano-vllm workload (256 requests, in and out
    lengths uniform in 100..1024, EOS ignored)."""
    from tokenwise.benchmarks import throughput as bench

    opts = ctx.options
    model, flags = workload_model(ctx)
    lengths = ctx.size("4:12", "100:1024")
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "t.json")
        flags += ["--model", model, "--num-prompts", str(ctx.size(4, opts["num_prompts"])),
                  "--random-input-len", lengths, "--random-output-len", lengths,
                  "--max-model-len", ctx.size("512", "2048"), "--max-num-seqs", str(opts["max_num_seqs"]),
                  "--max-num-batched-tokens", str(opts["max_num_batched_tokens"]),
                  "--seed", str(ctx.seed), "--device", ctx.device, "--output-json", out]  # fmt: skip
        start = time.perf_counter()
        bench.run(parser.parse_args(flags))
        total = time.perf_counter() - start
        with open(out) as f:
            res = json.load(f)
    release()
    ctx.figure("output_tokens_per_s", round(res["output_tokens_per_second"], 1), "tok/s",
               res["output_tokens_per_second"] > 0, total_tokens_per_s=round(
               res["tokens_per_second"], 1), elapsed_s=round(res["elapsed_time"], 2),
               startup_s=round(total - res["elapsed_time"], 1))  # fmt: skip


def throughput_hf(ctx: Context) -> None:
    """transformers' continuous batching (`generate_batch`'s engine) on the same requests."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from tokenwise.benchmarks.common import make_workload
    from tokenwise.benchmarks.hf_baselines import hf_num_blocks, run_hf_batch
    from tokenwise.benchmarks.roofline import ModelShape

    opts = ctx.options
    model_dir, _ = workload_model(ctx)
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    lengths = ctx.size((4, 12), (100, 1024))
    n = ctx.size(4, opts["num_prompts"])
    work = make_workload(n, lengths, lengths, config.vocab_size, ctx.seed)
    dtype = ctx.size(torch.float32, torch.bfloat16)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(ctx.device).eval()
    shape = ModelShape.from_config(config)
    need = sum(r.prompt_len + r.output_len for r in work) * 2 * shape.layers * shape.kv_heads
    need *= shape.head_dim * dtype.itemsize
    kv_bytes = int(need * 1.1)
    if ctx.device == "cuda":
        kv_bytes = min(kv_bytes, int(torch.cuda.mem_get_info()[0] * 0.6))
    cb = ContinuousBatchingConfig(
        num_blocks=hf_num_blocks(shape, kv_bytes, 256, dtype.itemsize),
        max_batch_tokens=opts["max_num_batched_tokens"],
        max_requests_per_batch=opts["max_num_seqs"],
    )
    run_hf_batch(model, work[:2], cb)  # warm-up
    res = run_hf_batch(model, work, cb)
    del model
    release()
    if res.error:
        raise RuntimeError(f"HF generate_batch: {res.error}")
    ctx.figure("output_tokens_per_s", round(res.output_tokens / res.elapsed, 1), "tok/s",
               res.output_tokens > 0, elapsed_s=round(res.elapsed, 2))  # fmt: skip


def breakdown(ctx: Context) -> None:
    """Median forward time per step size (decode-sized graphs vs larger eager steps)."""
    from tokenwise import LLM, SamplingParams
    from tokenwise.batchsize_stats import (
        get_batchsize_forward_time_samples,
        reset_batchsize_forward_time_stats,
    )
    from tokenwise.benchmarks.common import make_workload

    model, _ = workload_model(ctx)
    seqs = ctx.options["max_num_seqs"]
    vocab = json.load(open(os.path.join(model, "config.json")))["vocab_size"]
    lengths = ctx.size(((4, 12), (2, 6)), ((100, 1024), (100, 512)))
    work = make_workload(ctx.size(4, 64), *lengths, vocab, ctx.seed + 1)
    extra = ctx.size({"dtype": "float32"}, {"load_format": "dummy", "dtype": "bfloat16"})
    llm = LLM(model, device=ctx.device, skip_tokenizer_init=True, max_model_len=ctx.size(512, 2048),
              max_num_seqs=seqs, **extra, **mode_kwargs(ctx, "full_and_piecewise"))  # fmt: skip
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in work]
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in work]
    reset_batchsize_forward_time_stats(1e9)  # record every forward (synchronises), never log
    try:
        llm.generate(prompts, params, use_tqdm=False)
        samples = get_batchsize_forward_time_samples()
    finally:
        reset_batchsize_forward_time_stats(-1)
    kernels = top_kernels(ctx, llm, prompts[:16])
    del llm
    release()
    total = sum(sum(v) for v in samples.values()) or 1.0
    for lo, hi, label in ((1, seqs, "decode_sized"), (seqs + 1, 1 << 30, "larger")):
        times = [t for n, ts in samples.items() if lo <= n <= hi for t in ts]
        if times:
            ctx.figure(f"{label}_median_forward", round(statistics.median(times), 3), "ms",
                       steps=len(times), share=round(sum(times) / total, 3))  # fmt: skip
    ctx.figure("top_kernels", kernels, "ms", bool(kernels))


def top_kernels(ctx: Context, llm: Any, prompts: list[Any], count: int = 10) -> list[list[Any]]:
    """[name, total ms] of the kernels (CPU ops in a dry run) that took longest in 32 decode
    steps of up to 16 requests, from `torch.profiler`."""
    import torch

    from tokenwise import SamplingParams

    activities = [torch.profiler.ProfilerActivity.CPU]
    if ctx.device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    params = SamplingParams(temperature=0, max_tokens=ctx.size(4, 32), ignore_eos=True)
    with torch.profiler.profile(activities=activities) as prof:
        llm.generate(prompts, params, use_tqdm=False)
    attr = "device_time_total" if ctx.device == "cuda" else "cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, attr, 0), reverse=True)
    return [[e.key, round(getattr(e, attr, 0) / 1e3, 3)] for e in events[:count]]


PARTS = [
    Part("graph_modes", 150, graph_modes, "eager / PIECEWISE / FULL_AND_PIECEWISE agree"),
    Part("throughput", 120, throughput, "nano-vllm workload, tokenwise"),
]
LATE_PARTS = [
    Part("throughput_hf", 120, throughput_hf, "nano-vllm workload, HF continuous batching"),
    Part("breakdown", 90, breakdown, "forward time per step size"),
]
