"""The GPU path in one command: graph modes agree with eager, then throughput next to HF.

    python benchmarks/gpu_check.py                      # writes benchmarks/RESULTS.md
    python benchmarks/gpu_check.py --output /tmp/r.md   # elsewhere

Needs a CUDA device (and Triton for the full-graph modes). Steps:

1. Correctness, greedy decoding in three modes: eager (`enforce_eager`), PIECEWISE (compiled
   pieces between attention calls replayed from CUDA graphs, attention eager) and
   FULL_AND_PIECEWISE (whole decode steps replayed too). On the tiny fp32 test model the
   tokens must equal eager's exactly (the script fails otherwise); on the Qwen3-0.6B shape with
   dummy bf16 weights, where rounding legitimately flips near-ties, it reports for each mode
   how many sequences match and where the others first diverge.
2. Throughput on the nano-vllm workload: `tokenwise bench throughput` (256 requests, prompt and
   output lengths uniform in 100..1024, EOS ignored, Qwen3-0.6B shape, dummy weights), then
   transformers' continuous batching (`generate_batch`'s engine) on the same requests in the
   same process.
3. Where the time goes: median forward time per step size (the forward context's batch-size
   statistics) and the top CUDA kernels (`torch.profiler`) on a smaller run.
4. Each step's figures as markdown on stdout and in `--output`, between that step's markers,
   so the rest of the file is kept. Under a time limit per command, run the steps separately:
   `--steps correctness`, then `--steps throughput`, then `--steps breakdown`.

A failing step is reported in its section and the others still run; the exit status is 1 when a
step failed or the fp32 tokens differ.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the repository root, for tests.tiny_checkpoints

QWEN = os.path.join(HERE, "configs", "qwen3-0.6b")
MODES = {"eager": None, "piecewise": "PIECEWISE", "full_and_piecewise": "FULL_AND_PIECEWISE"}
STEPS = ("correctness", "throughput", "breakdown")


def _steps(text: str) -> list[str]:
    steps = [t.strip() for t in text.split(",") if t.strip()]
    if not steps or set(steps) - set(STEPS):
        raise argparse.ArgumentTypeError(f"steps are {', '.join(STEPS)}; got {text!r}")
    return steps


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output", default=os.path.join(HERE, "RESULTS.md"))
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--hf-kv-cache-gib", type=float, default=None, help="default: what fits")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument(
        "--steps",
        type=_steps,
        default=list(STEPS),
        help=f"comma-separated subset of {','.join(STEPS)} (default: all); each step "
        "rewrites only its own section of --output",
    )
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def vocab_size(model_dir: str) -> int:
    with open(os.path.join(model_dir, "config.json")) as f:
        return int(json.load(f)["vocab_size"])


def release() -> None:
    """Free the previous engine's memory (compiled code holds the model until a reset)."""
    import torch

    gc.collect()
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def make_llm(model: str, mode: str, device: str, **kwargs: Any) -> Any:
    from tokenwise import LLM

    if MODES[mode] is None:
        return LLM(model, enforce_eager=True, device=device, **kwargs)
    return LLM(model, enforce_eager=False, cudagraph_mode=MODES[mode], device=device, **kwargs)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (None when equal)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def greedy_runs(model: str, prompts: list[Any], params: list[Any], device: str, **kw: Any):
    """Per mode: (tokens per request, seconds to build the engine) or the error text."""
    runs: dict[str, Any] = {}
    for mode in MODES:
        start = time.perf_counter()
        try:
            llm = make_llm(model, mode, device, **kw)
            built = time.perf_counter() - start
            outs = llm.generate(prompts, params, use_tqdm=False)
            runs[mode] = ([o.outputs[0].token_ids for o in outs], built)
        except Exception as exc:  # reported in the table (e.g. no Triton for FULL graphs)
            runs[mode] = f"{type(exc).__name__}: {exc}"[:300]
        llm = None
        release()
    return runs


def correctness(device: str, seed: int) -> tuple[list[str], bool]:
    """Markdown rows for both models, and whether the tiny fp32 model matched exactly."""
    from tests.tiny_checkpoints import build_tiny_checkpoint
    from tokenwise.benchmarks.common import make_workload
    from tokenwise.sampling.params import SamplingParams

    rows, ok = [], True
    tiny = build_tiny_checkpoint(tempfile.mkdtemp(prefix="gpu-check-"), "Qwen3ForCausalLM")
    prompts = [f"Request {i}: the quick brown fox" for i in range(12)]
    params = [
        SamplingParams(temperature=0, max_tokens=8 + 2 * i, ignore_eos=True) for i in range(12)
    ]
    tiny_kw = {"num_gpu_blocks": 256, "max_num_seqs": 16}
    cases = [("tiny Qwen3 (test model)", "float32", tiny, prompts, params, tiny_kw)]
    work = make_workload(32, (64, 512), (64, 192), vocab_size(QWEN), seed)
    cases.append(
        (
            "Qwen3-0.6B shape, dummy weights",
            "bfloat16",
            QWEN,
            [{"prompt_token_ids": r.prompt_token_ids} for r in work],
            [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in work],
            {"load_format": "dummy", "skip_tokenizer_init": True, "max_model_len": 1024,
             "kv_cache_memory": 8 << 30, "max_num_seqs": 32},
        )
    )  # fmt: skip
    for name, dtype, model, ps, sp, kw in cases:
        runs = greedy_runs(model, ps, sp, device, dtype=dtype, seed=seed, **kw)
        reference = runs["eager"][0] if isinstance(runs["eager"], tuple) else None
        for mode, run in runs.items():
            if isinstance(run, str):
                rows.append(f"| {name} | {dtype} | {mode} | error: {run} | | |")
                ok = ok and not (dtype == "float32")
                continue
            tokens, built = run
            divs = [
                first_divergence(a, b) for a, b in zip(tokens, reference or tokens, strict=True)
            ]
            same = sum(d is None for d in divs)
            where = sorted(d for d in divs if d is not None)
            detail = f"{where[0]} / {statistics.median(where):.0f}" if where else "-"
            rows.append(
                f"| {name} | {dtype} | {mode} | {same}/{len(tokens)} | {detail} | {built:.1f} |"
            )
            if dtype == "float32" and same != len(tokens):
                ok = False
    return rows, ok


def throughput(args: argparse.Namespace, device: str) -> tuple[dict[str, Any], float]:
    """`tokenwise bench throughput` on the nano-vllm workload; its JSON and startup seconds."""
    from tokenwise.benchmarks import throughput as bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "t.json")
        flags = ["--model", QWEN, "--load-format", "dummy", "--dtype", "bfloat16",
                 "--num-prompts", str(args.num_prompts), "--random-input-len", "100:1024",
                 "--random-output-len", "100:1024", "--max-model-len", "2048",
                 "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens",
                 str(args.max_num_batched_tokens), "--seed", str(args.seed), "--device", device,
                 "--output-json", out]  # fmt: skip
        start = time.perf_counter()
        bench.run(parser.parse_args(flags))
        total = time.perf_counter() - start
        with open(out) as f:
            results = json.load(f)
    release()
    return results, total - results["elapsed_time"]


def hf_throughput(args: argparse.Namespace, device: str) -> Any:
    """transformers' continuous batching on the same requests (random bf16 weights)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from tokenwise.benchmarks.common import make_workload
    from tokenwise.benchmarks.hf_baselines import hf_num_blocks, run_hf_batch
    from tokenwise.benchmarks.roofline import ModelShape

    config = AutoConfig.from_pretrained(QWEN, local_files_only=True)
    work = make_workload(args.num_prompts, (100, 1024), (100, 1024), config.vocab_size, args.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to(device).eval()
    shape = ModelShape.from_config(config)
    need = sum(r.prompt_len + r.output_len for r in work) * 2 * shape.layers * shape.kv_heads
    need *= shape.head_dim * 2  # K and V, bf16
    free, _ = torch.cuda.mem_get_info()
    kv_bytes = int(args.hf_kv_cache_gib * (1 << 30)) if args.hf_kv_cache_gib else None
    kv_bytes = kv_bytes or min(int(need * 1.1), int(free * 0.6))
    cb = ContinuousBatchingConfig(
        num_blocks=hf_num_blocks(shape, kv_bytes, 256, 2),
        max_batch_tokens=args.max_num_batched_tokens,
        max_requests_per_batch=args.max_num_seqs,
    )
    run_hf_batch(model, work[:4], cb)  # warm-up
    result = run_hf_batch(model, work, cb)
    del model
    release()
    return result


def breakdown(args: argparse.Namespace, device: str) -> tuple[list[str], str]:
    """Median forward time per step size, and the top CUDA kernels, on 64 requests."""
    import torch

    from tokenwise.batchsize_stats import (
        get_batchsize_forward_time_samples,
        reset_batchsize_forward_time_stats,
    )
    from tokenwise.benchmarks.common import make_workload
    from tokenwise.sampling.params import SamplingParams

    work = make_workload(64, (100, 1024), (100, 512), vocab_size(QWEN), args.seed + 1)
    llm = make_llm(QWEN, "full_and_piecewise", device, load_format="dummy", dtype="bfloat16",
                   skip_tokenizer_init=True, max_model_len=2048, max_num_seqs=args.max_num_seqs,
                   max_num_batched_tokens=args.max_num_batched_tokens)  # fmt: skip
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in work]
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in work]
    reset_batchsize_forward_time_stats(1e9)  # record every forward (synchronises), never log
    llm.generate(prompts, params, use_tqdm=False)
    samples = get_batchsize_forward_time_samples()
    reset_batchsize_forward_time_stats(-1)
    total = sum(sum(v) for v in samples.values()) or 1.0
    rows = []
    for lo, hi, label in ((1, args.max_num_seqs, "decode-sized (graphs)"),
                          (args.max_num_seqs + 1, 1 << 30, "larger (eager)")):  # fmt: skip
        times = [t for n, ts in samples.items() if lo <= n <= hi for t in ts]
        if times:
            rows.append(f"| {label} | {len(times)} | {statistics.median(times):.2f} | "
                        f"{100 * sum(times) / total:.0f}% |")  # fmt: skip
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        llm.generate(prompts[:16], [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)] * 16, use_tqdm=False)  # fmt: skip
    sort = "cuda_time_total" if device == "cuda" else "cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=15)
    llm = None
    release()
    return rows, table


def correctness_section(device: str, seed: int) -> tuple[list[str], bool]:
    rows, ok = correctness(device, seed)
    head = "| model | dtype | mode | sequences equal to eager | first divergence (min / median) | engine start s |"  # fmt: skip
    return ["### Greedy outputs against eager", "", head, "|---|---|---|---|---|---|", *rows], ok


def throughput_section(args: argparse.Namespace, device: str) -> list[str]:
    lines = [
        f"### Throughput: nano-vllm workload ({args.num_prompts} requests, input and output "
        "lengths uniform in 100..1024, Qwen3-0.6B shape, dummy weights, bf16, EOS ignored)",
        "",
        "| engine | output tok/s | total tok/s | elapsed s |",
        "|---|---|---|---|",
    ]
    try:
        tw, startup = throughput(args, device)
        lines.append(
            f"| tokenwise `bench throughput` (default GPU settings: compiled, "
            f"FULL_AND_PIECEWISE graphs; start-up {startup:.0f} s not timed) | "
            f"{tw['output_tokens_per_second']:.0f} | {tw['tokens_per_second']:.0f} | "
            f"{tw['elapsed_time']:.1f} |"
        )
    except Exception as exc:
        lines.append(f"| tokenwise | error: {type(exc).__name__}: {str(exc)[:200]} | | |")
        release()
    if args.skip_hf:
        return lines + ["| HF generate_batch | skipped (--skip-hf) | | |"]
    try:
        hf = hf_throughput(args, device)
    except Exception as exc:  # e.g. out of memory while loading: keep tokenwise's figures
        hf = None
        lines.append(f"| HF generate_batch | error: {type(exc).__name__}: {str(exc)[:200]} | | |")
        release()
    if hf is not None and hf.error:
        lines.append(f"| HF generate_batch | error: {hf.error} | | |")
    elif hf is not None:
        total = (hf.output_tokens + hf.prompt_tokens) / hf.elapsed
        lines.append(
            f"| HF `generate_batch` engine (continuous batching, same requests) | "
            f"{hf.output_tokens / hf.elapsed:.0f} | {total:.0f} | {hf.elapsed:.1f} |"
        )
    return lines


def breakdown_section(args: argparse.Namespace, device: str) -> list[str]:
    rows, kernels = breakdown(args, device)
    return [
        "### Forward time per step (64 requests, FULL_AND_PIECEWISE)",
        "",
        "| step size | steps | median ms | share of forward time |",
        "|---|---|---|---|",
        *rows,
        "",
        "### Top kernels (16 requests, 32 tokens each, `torch.profiler`)",
        "",
        "```",
        kernels.rstrip(),
        "```",
    ]


def write_section(path: str, key: str, lines: list[str]) -> None:
    """Replace the section between this key's markers in `path` (or append it)."""
    begin, end = f"<!-- gpu_check:{key}:begin -->", f"<!-- gpu_check:{key}:end -->"
    section = "\n".join([begin, *lines, end])
    text = open(path).read() if os.path.exists(path) else ""
    if begin in text and end in text:
        text = text[: text.index(begin)] + section + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + section + "\n"
    with open(path, "w") as f:
        f.write(text)


def environment(device: str) -> str:
    import datetime

    import torch

    from tokenwise.attention.backends.selector import backend_name_for

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    name = torch.cuda.get_device_name() if device == "cuda" else device
    return (
        f"{name}, torch {torch.__version__}, triton {triton_version}, attention backend "
        f"{backend_name_for(device)}, {datetime.date.today().isoformat()}"
    )


def run_all(args: argparse.Namespace, device: str) -> int:
    env = environment(device)
    print(f"gpu_check: {env}", file=sys.stderr)
    note = f"Measured on {env} by `python benchmarks/gpu_check.py --steps {','.join(args.steps)}`."
    ok = True
    for step in args.steps:
        start = time.perf_counter()
        try:
            if step == "correctness":
                lines, ok = correctness_section(device, args.seed)
            elif step == "throughput":
                lines = throughput_section(args, device)
            else:
                lines = breakdown_section(args, device)
        except Exception as exc:  # report and go on: GPU time is too scarce to lose the rest
            lines = [f"### {step}", "", f"error: {type(exc).__name__}: {str(exc)[:500]}"]
            ok = False
            release()
        lines = [*lines, "", note, f"({time.perf_counter() - start:.0f} s)"]
        print("\n".join(lines) + "\n")
        write_section(args.output, step, lines)
    write_section(args.output, "status", ["Figures below come from a GPU run.", "", note])
    print(f"gpu_check: wrote {args.output}", file=sys.stderr)
    if not ok:
        print(
            "gpu_check: FAILED: a step failed, or a graph mode changed the greedy tokens of "
            "the fp32 test model (see the output)",
            file=sys.stderr,
        )
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.exit(
            "gpu_check: error: no CUDA device here. This script checks the GPU path (CUDA "
            "graphs, the Triton attention backend) and needs a CUDA GPU; on a CPU run the test "
            "suite instead (make test)."
        )
    return run_all(args, "cuda")


if __name__ == "__main__":
    sys.exit(main())
