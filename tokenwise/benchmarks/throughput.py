"""`tokenwise bench throughput`: offline throughput on a fixed batch of random requests.

All requests are submitted at once and the engine runs until every one has produced exactly
its output length (EOS is ignored, sampling is greedy), so the figures measure the engine and
not the model's taste for stopping early. Model loading is not timed. Prompts are token ids,
so no tokenizer is loaded and detokenization is not part of the cost.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from tokenwise.benchmarks.common import (
    add_workload_args,
    check_fits,
    check_model_dir,
    length_ranges,
    make_workload,
    write_json,
)
from tokenwise.entrypoints.engine_args import add_engine_args, engine_kwargs, positive_int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--num-prompts", type=positive_int, default=64, help="requests to run (default: 64)"
    )
    add_workload_args(parser, input_len=128, output_len=128)
    parser.add_argument("--output-json", default=None, metavar="PATH", help="write results here")
    add_engine_args(parser)


def run(args: argparse.Namespace) -> int:
    check_model_dir(args.model)  # before the slow imports
    input_range, output_range = length_ranges(args)
    kwargs = engine_kwargs(args)
    baseline = None
    ranks = {
        "data_parallel_size": args.data_parallel_size,
        "tensor_parallel_size": args.tensor_parallel_size,
        "pipeline_parallel_size": args.pipeline_parallel_size,
    }
    parallel = {name: size for name, size in ranks.items() if size > 1}
    if parallel:
        # The same workload on one process first, so the figure comes with its own baseline.
        one = {**kwargs, **dict.fromkeys(ranks, 1), "data_parallel_size_local": None}
        baseline, _, _, _ = _timed_run(args, one, input_range, output_range)
    elapsed, outputs, model_config, busy = _timed_run(args, kwargs, input_range, output_range)

    num_prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    num_output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    results = throughput_results(len(outputs), num_prompt_tokens, num_output_tokens, elapsed)
    print(
        f"Throughput: {results['requests_per_second']:.2f} requests/s, "
        f"{results['tokens_per_second']:.2f} total tokens/s, "
        f"{results['output_tokens_per_second']:.2f} output tokens/s"
    )
    print(
        f"Elapsed: {elapsed:.2f} s for {len(outputs)} requests, {num_prompt_tokens} prompt "
        f"tokens, {num_output_tokens} output tokens"
    )
    results["config"] = {
        "model": model_config.model,
        "dtype": str(model_config.dtype).replace("torch.", ""),
        "num_prompts": args.num_prompts,
        "input_len": list(input_range),
        "output_len": list(output_range),
        "seed": args.seed,
    }
    if busy is not None:
        shares = ", ".join(f"stage {i} {100 * b:.0f}%" for i, b in enumerate(busy))
        print(f"Pipeline stages busy (share of the run spent computing): {shares}")
        results["stage_busy_fraction"] = busy
    if baseline is not None:
        ratio = baseline / max(elapsed, 1e-9)
        what = ", ".join(f"{name}={size}" for name, size in parallel.items())
        print(
            f"Parallel ({what}): {ratio:.2f}x the throughput of one process "
            f"({elapsed:.2f} s vs {baseline:.2f} s, same workload, this run)"
        )
        results["single_process_elapsed_time"] = baseline
        results["speedup_vs_single_process"] = ratio
    write_json(args.output_json, results)
    return 0


def _timed_run(
    args: argparse.Namespace,
    kwargs: dict[str, Any],
    input_range: tuple[int, int],
    output_range: tuple[int, int],
) -> tuple[float, list[Any], Any, list[float] | None]:
    """Build an engine, run the workload once (loading not timed), shut the engine down.

    Under pipeline parallelism also each stage's busy fraction: the seconds it spent
    computing during the run over the run's wall time (None otherwise)."""
    from tokenwise.entrypoints.llm import LLM
    from tokenwise.sampling.params import SamplingParams

    # No tokenizer: the workload is token ids (whatever the engine flags said).
    llm = LLM(args.model, **{**kwargs, "skip_tokenizer_init": True})
    model_config = llm.engine_config.model
    check_fits(input_range, output_range[1], model_config.max_model_len)
    requests = make_workload(
        args.num_prompts, input_range, output_range, model_config.vocab_size, args.seed
    )
    prompts: list[Any] = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [
        SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests
    ]
    busy_seconds = getattr(llm.llm_engine.runner.pipeline, "stage_busy_seconds", None)
    try:
        before = busy_seconds() if busy_seconds is not None else None
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        busy = None
        if busy_seconds is not None and before is not None:
            busy = [
                (b - a) / max(elapsed, 1e-9) for a, b in zip(before, busy_seconds(), strict=True)
            ]
    finally:
        llm.shutdown()
    return elapsed, outputs, model_config, busy


def throughput_results(
    num_requests: int, num_prompt_tokens: int, num_output_tokens: int, elapsed: float
) -> dict[str, Any]:
    """The figures `bench throughput` prints and writes, from raw counts and wall time."""
    elapsed = max(elapsed, 1e-9)
    total = num_prompt_tokens + num_output_tokens
    return {
        "elapsed_time": elapsed,
        "num_requests": num_requests,
        "num_prompt_tokens": num_prompt_tokens,
        "num_output_tokens": num_output_tokens,
        "total_num_tokens": total,
        "requests_per_second": num_requests / elapsed,
        "tokens_per_second": total / elapsed,
        "output_tokens_per_second": num_output_tokens / elapsed,
    }
