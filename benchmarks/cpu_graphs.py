"""One CPU decode stream with CPU graphs (recorded C kernels, the default) and without, in one run.

    python benchmarks/cpu_graphs.py --config llama-100m [-q int4] [--dtype bfloat16] [--repeats 3]

Two engines on the same dummy weights, `cudagraph_mode` FULL_DECODE_ONLY (CPU graphs: each
decode step replays its recorded kernel calls, `tokenwise.compilation.cpu_graph`) and NONE
(`enforce_eager=True`: the same kernels called from Python), take turns generating one stream
(a 256-token prompt, 128 greedy tokens, EOS ignored), so machine noise hits both alike.
Prints the per-token decode time of each (median over repeats), their ratio, whether the
greedy tokens and logprobs are identical, how many steps replayed a graph, and the CPU flags.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenwise import LLM, SamplingParams  # noqa: E402
from tokenwise.config import CUDAGraphMode  # noqa: E402
from tokenwise.model_config import cpu_flag_summary  # noqa: E402

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
PROMPT_LEN = 256
OUTPUT_LEN = 128


def runner_of(llm: LLM):
    return llm.llm_engine.runner


def timed_stream(llm: LLM, prompt: list[int]) -> tuple[float, list[int], list[float], int]:
    """Seconds per decoded token (first token excluded), tokens, logprobs, graph steps."""
    runner = runner_of(llm)
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0, ignore_eos=True, logprobs=0)
    engine.add_request("r", {"prompt_token_ids": prompt}, params)
    stamps, graph_steps, out = [], 0, None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
        stamps.append(time.perf_counter())
        graph_steps += runner.last_graph[0] == CUDAGraphMode.FULL
    assert out is not None and out.finished
    completion = out.outputs[0]
    lps = [next(iter(d.values())).logprob for d in completion.logprobs]
    per_token = (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1)
    return per_token, list(completion.token_ids), lps, graph_steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="llama-100m", help="a folder of benchmarks/configs")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--quantization", "-q", default=None, help="e.g. int8, int4")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    common = dict(
        model=os.path.join(CONFIGS, args.config),
        dtype=args.dtype,
        load_format="dummy",
        max_model_len=PROMPT_LEN + OUTPUT_LEN + 16,
        max_num_seqs=1,
        kv_cache_memory=64 << 20,
        quantization=args.quantization,
        skip_tokenizer_init=True,
    )
    engines = {"graphs": LLM(**common), "eager": LLM(enforce_eager=True, **common)}
    vocab = runner_of(engines["graphs"]).model_config.vocab_size
    prompt = torch.randint(0, vocab, (PROMPT_LEN,), generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {name: [] for name in engines}
    results = {}
    for _ in range(args.repeats):
        for name, llm in engines.items():
            per_token, tokens, lps, graph_steps = timed_stream(llm, prompt.tolist())
            times[name].append(per_token)
            results[name] = (tokens, lps, graph_steps)
    graphs, eager = (statistics.median(times[n]) * 1e3 for n in ("graphs", "eager"))
    weights = args.quantization or args.dtype
    print(f"{args.config} {weights}, batch 1, {torch.get_num_threads()} threads; CPU flags: "
          f"{cpu_flag_summary()}")  # fmt: skip
    print("| engine | ms per decoded token | tok/s | graph steps |")
    print("|---|---|---|---|")
    for name, ms in (("CPU graphs", graphs), ("eager", eager)):
        steps = results["graphs" if name == "CPU graphs" else "eager"][2]
        print(f"| {name} | {ms:.2f} | {1e3 / ms:.1f} | {steps} |")
    print(f"speedup of CPU graphs: {eager / graphs:.2f}x")
    same_tokens = results["graphs"][0] == results["eager"][0]
    same_lps = results["graphs"][1] == results["eager"][1]
    print(f"greedy tokens identical: {same_tokens}; logprobs identical: {same_lps}")


if __name__ == "__main__":
    main()
