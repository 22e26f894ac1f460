"""`tokenwise bench latency`: how long one batch takes from submission to its last token.

The same-shaped batch (`--batch-size` prompts of `--input-len` tokens, each generating exactly
`--output-len` tokens, greedy, EOS ignored) runs `--num-iters-warmup` untimed times, then
`--num-iters` timed times. Every iteration gets fresh random prompts: repeating one batch would
let the prefix cache skip the prefill from the second iteration on, and the figure would then
describe a cache hit rather than a request.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from tokenwise.benchmarks.common import (
    check_fits,
    check_model_dir,
    make_workload,
    summarize,
    write_json,
)
from tokenwise.entrypoints.engine_args import (
    add_engine_args,
    engine_kwargs,
    non_negative_int,
    positive_int,
)

PERCENTILES = (10, 25, 50, 75, 90, 99)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument("--batch-size", type=positive_int, default=8, help="prompts per batch (8)")
    g.add_argument("--input-len", type=positive_int, default=32, help="prompt tokens (32)")
    g.add_argument("--output-len", type=positive_int, default=128, help="output tokens (128)")
    g.add_argument(
        "--num-iters-warmup",
        type=non_negative_int,
        default=2,
        help="untimed iterations first (default: 2)",
    )
    g.add_argument(
        "--num-iters", type=positive_int, default=10, help="timed iterations (default: 10)"
    )
    parser.add_argument("--output-json", default=None, metavar="PATH", help="write results here")
    add_engine_args(parser)


def run(args: argparse.Namespace) -> int:
    check_model_dir(args.model)  # before the slow imports
    from tokenwise.entrypoints.llm import LLM
    from tokenwise.sampling.params import SamplingParams

    llm = LLM(args.model, **{**engine_kwargs(args), "skip_tokenizer_init": True})
    model_config = llm.engine_config.model
    check_fits((args.input_len, args.input_len), args.output_len, model_config.max_model_len)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    total_iters = args.num_iters_warmup + args.num_iters

    def one_batch(iteration: int) -> tuple[float, int]:
        batch = make_workload(
            args.batch_size,
            (args.input_len, args.input_len),
            (args.output_len, args.output_len),
            model_config.vocab_size,
            seed=args.seed * total_iters + iteration,  # fresh prompts, still reproducible
        )
        prompts: list[Any] = [{"prompt_token_ids": r.prompt_token_ids} for r in batch]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        return elapsed, sum(len(c.token_ids) for o in outputs for c in o.outputs)

    for i in range(args.num_iters_warmup):
        one_batch(i)
    latencies, output_tokens = [], []
    for i in range(args.num_iters):
        elapsed, tokens = one_batch(args.num_iters_warmup + i)
        latencies.append(elapsed)
        output_tokens.append(tokens)

    stats = summarize(latencies, PERCENTILES)
    print(f"Avg latency: {stats['mean']:.4f} seconds")
    for pct in (50, 90, 99):
        print(f"{pct}% percentile latency: {stats[f'p{pct}']:.4f} seconds")
    results = {
        "avg_latency": stats["mean"],
        "latencies": latencies,
        "percentiles": {str(p): stats[f"p{p}"] for p in PERCENTILES},
        "num_output_tokens_per_iter": output_tokens,
        "config": {
            "model": model_config.model,
            "dtype": str(model_config.dtype).replace("torch.", ""),
            "batch_size": args.batch_size,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "num_iters_warmup": args.num_iters_warmup,
            "num_iters": args.num_iters,
            "seed": args.seed,
        },
    }
    write_json(args.output_json, results)
    return 0
