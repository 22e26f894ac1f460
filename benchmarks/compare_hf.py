"""tokenwise vs Hugging Face transformers: one process, same machine, weights and prompts.

    python benchmarks/compare_hf.py --config benchmarks/configs/llama-100m --repeats 3

Engines (`--engines`, comma-separated):
- tokenwise: `LLM.generate` on all requests at once (continuous batching, paged KV cache).
- hf: `model.generate` on padded batches of `--hf-batch-size` requests in workload order, left
  padding. A padded batch runs until its longest request is done (`min_new_tokens =
  max_new_tokens =` the batch's longest output), but only each request's own output length is
  counted: the tokens a request generates past its length are work a user of `generate` pays
  for and throws away.
- hf_batch: transformers' continuous batching (the manager behind `generate_batch`), one
  request per prompt with its own `max_new_tokens`. Its KV cache gets the same bytes as
  tokenwise's (`--kv-cache-memory`): left alone it sizes itself to 90% of the machine's RAM.

Same weights: the HF model is built from the config with `--seed` and saved as safetensors to
a temporary directory, which tokenwise then loads (`load_format="auto"`). With `--engines
tokenwise` alone nothing is saved and tokenwise uses `load_format="dummy"`.

Workload: `--num-prompts` random token-id prompts, lengths uniform in `--input-len`, outputs
uniform in `--output-len` (seeded), greedy, EOS ignored. With `--repeats N` the engines run
alternately (tokenwise, hf, hf_batch, tokenwise, ...) so that machine noise hits all of them,
and the table shows each engine's median run. Each engine has one untimed warm-up first.

Roofline: the workload's useful FLOPs (`tokenwise.benchmarks.roofline.request_flops`: 2 x
non-embedding matmul params per processed token, 2 x hidden x vocab per output token for the
lm_head, 4 x layers x heads x head_dim x context per token for attention) divided by (the
matmul rate in `--dtype` of a 2048^3 product measured in this run x elapsed): the fraction of
the machine's matmul ceiling the engine turned into useful work. HF generate's padding work is
not credited, so every engine is measured against the same useful FLOPs.

The allocator variables (`MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`) only act when set
before the process starts, so the script re-executes itself once with them when they are
missing (see docs/performance.md: large temporaries are otherwise page-faulted anew).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from typing import Any

from tokenwise.benchmarks.common import BenchRequest, make_workload, parse_len_range, write_json
from tokenwise.benchmarks.hf_baselines import (
    EngineRun,
    hf_num_blocks,
    run_hf_batch,
    run_hf_generate,
)
from tokenwise.benchmarks.roofline import ModelShape, measure_matmul_flops, workload_flops
from tokenwise.entrypoints.engine_args import parse_memory_size, positive_int

ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}
ENGINES = ("tokenwise", "hf", "hf_batch")
HERE = os.path.dirname(os.path.abspath(__file__))


def ensure_allocator_env() -> None:
    """Re-exec this script once with the allocator variables set (user values are kept)."""
    if all(name in os.environ for name in ALLOCATOR_ENV):
        return
    env = {**ALLOCATOR_ENV, **os.environ}
    os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]], env)


def _engines(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = sorted(set(names) - set(ENGINES))
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"engines are {', '.join(ENGINES)}; got {text!r}")
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=os.path.join(HERE, "configs", "llama-100m"))
    p.add_argument("--num-prompts", type=positive_int, default=64)
    p.add_argument("--input-len", type=parse_len_range, default=(32, 512), metavar="MIN:MAX")
    p.add_argument("--output-len", type=parse_len_range, default=(32, 256), metavar="MIN:MAX")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engines", type=_engines, default=list(ENGINES))
    p.add_argument("--repeats", type=positive_int, default=1)
    p.add_argument("--hf-batch-size", type=positive_int, default=16)
    p.add_argument("--max-num-seqs", type=positive_int, default=128)
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=2048)
    p.add_argument("--kv-cache-memory", type=parse_memory_size, default=parse_memory_size("2GiB"))
    p.add_argument("--compile", action="store_true", help="tokenwise with torch.compile")
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads (all cores)")
    p.add_argument("--plot", default=None, metavar="PNG")
    p.add_argument("--output-json", default=None, metavar="PATH")
    return p.parse_args(argv)


def run_tokenwise(llm: Any, workload: list[BenchRequest]) -> EngineRun:
    from tokenwise.batchsize_stats import (
        get_batchsize_forward_time_samples,
        reset_batchsize_forward_time_stats,
    )
    from tokenwise.sampling.params import SamplingParams

    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in workload]
    params = [
        SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in workload
    ]
    reset_batchsize_forward_time_stats(1e9)  # record every forward, never log
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    samples = get_batchsize_forward_time_samples()
    reset_batchsize_forward_time_stats(-1)
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return EngineRun("tokenwise", elapsed, out_tokens, prompt_tokens, extra={"samples": samples})


def summarize_runs(
    runs: dict[str, list[EngineRun]], flops: float, matmul_rate: float
) -> dict[str, dict[str, Any]]:
    """Per engine: its median run's figures, the ratio to HF generate and the roofline share."""
    rows: dict[str, dict[str, Any]] = {}
    for engine, engine_runs in runs.items():
        ok = sorted((r for r in engine_runs if r.error is None), key=lambda r: r.elapsed)
        if not ok:
            rows[engine] = {"error": engine_runs[0].error}
            continue
        mid = ok[(len(ok) - 1) // 2]
        rows[engine] = {
            "elapsed": mid.elapsed,
            "all_elapsed": [r.elapsed for r in engine_runs if r.error is None],
            "output_tok_s": mid.output_tokens / mid.elapsed,
            "total_tok_s": (mid.output_tokens + mid.prompt_tokens) / mid.elapsed,
            "output_tokens": mid.output_tokens,
            "roofline_fraction": flops / (matmul_rate * mid.elapsed),
            **{k: v for k, v in mid.extra.items() if k != "samples"},
        }
    hf = rows.get("hf", {}).get("output_tok_s")
    for row in rows.values():
        if "output_tok_s" in row:
            row["vs_hf"] = row["output_tok_s"] / hf if hf else None
    return rows


def format_table(rows: dict[str, dict[str, Any]]) -> str:
    head = f"{'engine':<10} {'out tok/s':>10} {'total tok/s':>12} {'elapsed s':>10} "
    lines = [head + f"{'vs HF gen':>10} {'roofline':>9}"]
    for engine, row in rows.items():
        if "error" in row:
            lines.append(f"{engine:<10} error: {row['error']}")
            continue
        ratio = f"{row['vs_hf']:.2f}x" if row.get("vs_hf") else "-"
        lines.append(
            f"{engine:<10} {row['output_tok_s']:>10.1f} {row['total_tok_s']:>12.1f} "
            f"{row['elapsed']:>10.2f} {ratio:>10} {row['roofline_fraction'] * 100:>8.1f}%"
        )
    return "\n".join(lines)


# Issue #21's targets: tokenwise vs HF generate, vs HF generate_batch, and (fp32) the roofline.
TARGETS = {"vs_hf": 2.5, "vs_hf_batch": 5.0, "roofline_fp32": 0.70}


def format_targets(rows: dict[str, dict[str, Any]], dtype: str) -> str:
    """One line per target: tokenwise's figure, the target and whether it was met."""
    ours = rows.get("tokenwise", {})
    if "elapsed" not in ours:
        return "targets: no tokenwise run"
    checks: list[tuple[str, float | None, float, str]] = []
    for engine, key, label in (
        ("hf", "vs_hf", "HF generate"),
        ("hf_batch", "vs_hf_batch", "HF generate_batch"),
    ):
        theirs = rows.get(engine, {}).get("elapsed")
        ratio = theirs / ours["elapsed"] if theirs else None
        checks.append((f"tokenwise vs {label}", ratio, TARGETS[key], "x"))
    if dtype == "float32":
        checks.append(
            ("roofline share, float32", ours["roofline_fraction"], TARGETS["roofline_fp32"], "%")
        )
    lines = []
    for name, value, target, unit in checks:

        def show(v: float, unit: str = unit) -> str:
            return f"{v * 100:.1f}%" if unit == "%" else f"{v:.2f}x"

        verdict = "not run" if value is None else ("met" if value >= target else "NOT met")
        got = "-" if value is None else show(value)
        lines.append(f"target {name}: {got} (>= {show(target)}): {verdict}")
    return "\n".join(lines)


def plot(path: str, rows: dict[str, dict[str, Any]], samples: dict[int, list[float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (bars, fwd) = plt.subplots(1, 2, figsize=(11, 4))
    named = {e: r["output_tok_s"] for e, r in rows.items() if "output_tok_s" in r}
    bars.bar(list(named), list(named.values()), color="tab:blue")
    bars.set_ylabel("output tokens/s")
    bars.set_title("Throughput (median run)")
    sizes = sorted(samples)
    fwd.scatter(sizes, [statistics.median(samples[s]) for s in sizes], s=10)
    fwd.set_xscale("log")
    fwd.set_xlabel("tokens in the forward pass")
    fwd.set_ylabel("median forward time (ms)")
    fwd.set_title("tokenwise forward time per batch size")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_engines(args: argparse.Namespace, tmp: str) -> tuple[Any, Any, ModelShape]:
    """The HF model (when an HF engine runs) and the tokenwise LLM over the same weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tokenwise.entrypoints.llm import LLM

    config = AutoConfig.from_pretrained(args.config, local_files_only=True)
    dtype = getattr(torch, args.dtype)
    hf_model, model_dir, load_format = None, args.config, "dummy"
    if {"hf", "hf_batch"} & set(args.engines):
        torch.manual_seed(args.seed)
        hf_model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
        hf_model.save_pretrained(tmp)
        model_dir, load_format = tmp, "auto"
    llm = None
    if "tokenwise" in args.engines:
        llm = LLM(
            model_dir,
            dtype=args.dtype,
            seed=args.seed,
            load_format=load_format,
            skip_tokenizer_init=True,
            max_model_len=args.input_len[1] + args.output_len[1],
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            kv_cache_memory=args.kv_cache_memory,
            enable_prefix_caching=False,  # repeats reuse the prompts: no hits across runs
            enforce_eager=not args.compile,
            device="cpu",
        )
    return hf_model, llm, ModelShape.from_config(config)


def run_rounds(
    args: argparse.Namespace, workload: list[BenchRequest], vocab_size: int
) -> tuple[dict[str, list[EngineRun]], ModelShape]:
    """One untimed warm-up per engine, then `--repeats` rounds of alternating timed runs."""
    import torch
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    warmup = make_workload(2, (16, 16), (4, 4), vocab_size, args.seed + 1)
    with tempfile.TemporaryDirectory(prefix="tokenwise-compare-") as tmp:
        print("building the models...", file=sys.stderr)
        hf_model, llm, shape = build_engines(args, tmp)
        itemsize = torch.finfo(getattr(torch, args.dtype)).bits // 8
        cb_config = ContinuousBatchingConfig(
            num_blocks=hf_num_blocks(shape, args.kv_cache_memory, 256, itemsize),
            max_batch_tokens=args.max_num_batched_tokens,
            max_requests_per_batch=args.max_num_seqs,
        )
        runners = {
            "tokenwise": lambda w: run_tokenwise(llm, w),
            "hf": lambda w: run_hf_generate(hf_model, w, args.hf_batch_size),
            "hf_batch": lambda w: run_hf_batch(hf_model, w, cb_config),
        }
        runs: dict[str, list[EngineRun]] = {e: [] for e in args.engines}
        for engine in args.engines:
            runners[engine](warmup)
        for repeat in range(args.repeats):
            for engine in args.engines:
                run = runners[engine](workload)
                runs[engine].append(run)
                status = run.error or f"{run.output_tokens / max(run.elapsed, 1e-9):.1f} out tok/s"
                print(f"[{repeat + 1}/{args.repeats}] {engine}: {status}", file=sys.stderr)
    return runs, shape


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    from transformers.utils import logging as hf_logging

    from tokenwise.model_config import cpu_flag_summary, cpu_supports_bf16

    if args.threads:
        torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()
    # Without psutil, transformers' continuous batching logs an ERROR about it on every start;
    # we size its cache ourselves, so drop only that message and keep real errors visible.
    logging.getLogger("ContinuousBatchingLogger").addFilter(
        lambda record: "psutil" not in record.getMessage()
    )
    if args.dtype == "bfloat16" and not cpu_supports_bf16():
        print(
            "warning: this CPU has no native bf16 matmul (AVX512_BF16 or AMX): HF's bf16 "
            "matmuls are emulated or scalar here; tokenwise packs bf16 weights for oneDNN or, "
            "without bf16 kernels, widens them to fp32 (tokenwise.layers.cpu_prepack)",
            file=sys.stderr,
        )
    with open(os.path.join(args.config, "config.json")) as f:
        vocab_size = int(json.load(f)["vocab_size"])
    workload = make_workload(
        args.num_prompts, args.input_len, args.output_len, vocab_size, args.seed
    )
    print(f"measuring the {args.dtype} matmul rate...", file=sys.stderr)
    matmul_rate = measure_matmul_flops(2048, 5, args.dtype)
    if args.dtype != "float32":
        # The ceiling is the fastest way this machine multiplies the weights: where bf16 has
        # no fast kernels, fp32 on widened weights is (and is what tokenwise then does).
        matmul_rate = max(matmul_rate, measure_matmul_flops(2048, 5, "float32"))
    runs, shape = run_rounds(args, workload, vocab_size)

    flops = workload_flops(shape, workload)
    rows = summarize_runs(runs, flops, matmul_rate)
    prompt_tokens = sum(r.prompt_len for r in workload)
    output_tokens = sum(r.output_len for r in workload)
    print(
        f"{args.num_prompts} requests, {prompt_tokens} prompt + {output_tokens} output tokens, "
        f"{args.dtype}, {torch.get_num_threads()} threads; matmul ceiling "
        f"{matmul_rate / 1e9:.0f} GFLOP/s; workload {flops / 1e12:.2f} TFLOP; CPU flags: "
        f"{cpu_flag_summary()}"
    )
    print(format_table(rows))
    print(format_targets(rows, args.dtype))
    tokenwise_runs = runs.get("tokenwise") or []
    samples = tokenwise_runs[-1].extra.get("samples", {}) if tokenwise_runs else {}
    if args.plot:
        plot(args.plot, rows, samples)
    forward_ms = {str(n): statistics.median(t) for n, t in sorted(samples.items())}
    write_json(
        args.output_json,
        {
            "config": {k: v for k, v in vars(args).items() if k not in ("plot", "output_json")},
            "matmul_flops_per_s": matmul_rate,
            "workload_flops": flops,
            "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens,
            "engines": rows,
            "tokenwise_forward_median_ms": forward_ms,
        },
    )
    return 0


if __name__ == "__main__":
    ensure_allocator_env()
    try:
        sys.exit(main())
    except (ValueError, FileNotFoundError) as exc:  # bad flags, config or lengths: one line
        sys.exit(f"compare_hf: error: {exc}")
