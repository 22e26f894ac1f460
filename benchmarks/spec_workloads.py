"""Speculative decoding on text that is not degenerate: code editing, summarising, free writing.

    python benchmarks/spec_workloads.py [--prompts 4] [--rounds 2] [--tokens 128]
        [--modes off,ngram-4,suffix-8,suffix] [--cost-model qwen3-0.6b] [--cost-tokens 24]

Workloads over functions of this repository (`tokenwise/**/*.py`, 10-30 lines, one per file,
in a fixed order), one stream, greedy unless said, EOS ignored:

- edit: the function, then "# The same function, with `OLD` renamed to `NEW`:" and its `def`
  line with the rename made: the answer repeats most of the prompt (a rewrite request);
- summary: the function, then a docstring that starts to describe it;
- free: the function's first three lines only: the rest is new text;
- free-sampled: the same at temperature 1 (seed 0): the built-in model's greedy text soon
  repeats itself, its sampled text far less, so this is where drafts fail and the per-request
  draft budget has to turn speculation off.

The text comes from the built-in model (`tokenwise/default_model.py`: 4M parameters, trained on
Python): the one model here that writes code rather than noise; a random-weight model repeats
itself, which any proposer predicts. Modes take turns round after round and the median round
is printed (also the best: on a shared machine others only slow a round down), with each
mode's ratio to no speculation, the share of drafts accepted and the tokens per step.

The built-in model's steps are ~1 ms, so per-step overheads weigh far more than on a real model.
`--cost-model SHAPE` (a folder of `benchmarks/configs`, random weights, fp32) therefore also
times that shape's plain decode step and its steps verifying d drafts, and projects each
mode's ratio at that shape: the built-in run's own sequence of draft counts per step, costed
at the shape's measured step times (the tokens emitted are the built-in run's). With
`--threads 1` CPU time is measured beside the wall clock ("vs off (CPU time)", and the
shape's step costs): on a machine shared with other work, the figure they disturb least.
CPU flags are printed with the figures.
"""

from __future__ import annotations

import argparse
import ast
import copy
import gc
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from tokenwise import LLM, SamplingParams  # noqa: E402
from tokenwise.model_config import cpu_flag_summary  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "benchmarks" / "configs"
MODES = {
    "off": None,
    "ngram-4": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4},
    "suffix-8": {"method": "suffix", "num_speculative_tokens": 8},
    "suffix": {"method": "suffix"},  # vLLM's defaults: up to 24 drafts (the tree's depth)
}


def repo_functions(count: int, min_lines: int = 10, max_lines: int = 30) -> list[ast.FunctionDef]:
    """`count` top-level functions of this repository with their source, one per file."""
    found: list[Any] = []
    for path in sorted((REPO / "tokenwise").rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        lines = source.splitlines()
        for node in ast.parse(source).body:
            if not isinstance(node, ast.FunctionDef) or node.end_lineno is None:
                continue
            if min_lines <= node.end_lineno - node.lineno + 1 <= max_lines and node.args.args:
                node.source = "\n".join(lines[node.lineno - 1 : node.end_lineno])  # type: ignore[attr-defined]
                found.append(node)
                break
        if len(found) == count:
            break
    return found


def workload_prompts(kind: str, count: int) -> list[str]:
    prompts = []
    for fn in repo_functions(count):
        code = fn.source  # type: ignore[attr-defined]
        if kind == "edit":
            old = fn.args.args[0].arg
            new = f"{old}_value" if old != "self" else "this"
            renamed = re.sub(rf"\b{re.escape(old)}\b", new, code.splitlines()[0])
            prompts.append(
                f"{code}\n\n\n# The same function, with `{old}` renamed to `{new}`:\n{renamed}\n"
            )
        elif kind == "summary":
            prompts.append(f'{code}\n\n\n"""What `{fn.name}` does, in short:\n\n')
        else:
            prompts.append("\n".join(code.splitlines()[:3]) + "\n")
    return prompts


class StepLog:
    """Wraps a drafter's `record` to log each step's draft count (one stream)."""

    def __init__(self, llm: LLM) -> None:
        self.drafts: list[int] = []
        drafter = llm.llm_engine.drafter
        if drafter is None:
            return
        record = drafter.record

        def logged(result: Any, stats: Any) -> None:
            for item in result.sampled_requests:
                self.drafts.append(len(item.spec_token_ids))
            record(result, stats)

        drafter.record = logged  # type: ignore[method-assign]


def timed(
    llm: LLM, prompts: list[str], tokens: int, temperature: float = 0.0
) -> tuple[float, dict[str, float]]:
    """Out tok/s by the wall clock, and the run's speculation figures (with out tokens per
    CPU second as "cpu_tps": at one thread, what other processes on the machine disturb least)."""
    params = SamplingParams(temperature=temperature, seed=0, max_tokens=tokens, ignore_eos=True)
    before = copy.deepcopy(llm.llm_engine.get_stats())
    start, cpu_start = time.perf_counter(), time.process_time()
    generated = 0
    for prompt in prompts:
        out = llm.generate([prompt], params, use_tqdm=False)
        generated += len(out[0].outputs[0].token_ids)
    elapsed = time.perf_counter() - start
    cpu = time.process_time() - cpu_start
    after = llm.llm_engine.get_stats()
    steps = after.spec_decode_num_drafts - before.spec_decode_num_drafts
    proposed = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    return generated / elapsed, {
        "acceptance": accepted / proposed if proposed else 0.0,
        "mean_len": 1 + accepted / steps if steps else 1.0,
        "generated": generated,
        "cpu_tps": generated / cpu,
    }


def step_costs(
    shape: str, ds: list[int], tokens: int, rounds: int, clock: Any = time.perf_counter
) -> dict[int, float]:
    """Seconds per step of a random-weight `shape` decoding one stream while verifying `d`
    drafts every step (any tokens: a step's cost does not depend on which are accepted),
    the fastest of `rounds`; d = 0 is a plain decode step. One engine, configured for suffix
    decoding (verifying steps of up to 8 rows replay CPU graphs, larger ones run eagerly), with
    a proposer that always proposes `d`. `spec_forced.py --costs` also times eager
    verification beside it."""
    prompt = list(range(3, 35))
    llm = LLM(
        str(CONFIGS / shape),
        load_format="dummy",
        dtype="float32",
        skip_tokenizer_init=True,
        speculative_config={"method": "suffix", "num_speculative_tokens": max(ds)},
        max_num_seqs=1,
        max_model_len=1024,  # not the shape's 40960: buffers sized for it are not needed here
        kv_cache_memory=256 << 20,
    )
    drafter = llm.llm_engine.drafter
    assert drafter is not None
    fixed = _Fixed()
    drafter.suffix = fixed  # type: ignore[assignment]
    drafter.budget.limit = lambda rid: fixed.d  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    prefill_only = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    costs: dict[int, float] = {}
    for r in range(rounds + 1):  # the first round warms up
        start = clock()
        llm.generate([{"prompt_token_ids": prompt}], prefill_only, use_tqdm=False)
        prefill = clock() - start
        for d in ds:
            fixed.d = d
            steps_before = llm.llm_engine.get_stats().num_steps_total
            start = clock()
            llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
            elapsed = clock() - start - prefill
            steps = llm.llm_engine.get_stats().num_steps_total - steps_before - 1
            if r:
                costs[d] = min(costs.get(d, float("inf")), elapsed / steps)
    llm.llm_engine.shutdown()
    return costs


class _Fixed:
    """Proposes `d` drafts every step, ones the model is unlikely to pick (so each step is
    one decode token plus `d` rejected drafts, and the step count stays fixed)."""

    d = 0
    num_tracked = 0

    def finish(self, *args: Any) -> None:
        pass

    def forget(self, alive: Any) -> None:
        pass

    def propose(
        self, tokens: Any, max_tokens: int | None = None, request_id: str = ""
    ) -> list[int]:
        n = self.d if max_tokens is None else min(self.d, max_tokens)
        return [(int(tokens[-1]) + 7) % 4096] * n


def projected(drafts: list[int], generated: int, costs: dict[int, float]) -> float:
    """Ratio to no speculation at the costed shape: `generated` tokens at one decode step each,
    against the logged steps at their draft counts' cost (interpolated between measured d)."""
    known = sorted(costs)

    def cost(d: int) -> float:
        if d in costs:
            return costs[d]
        hi = next((x for x in known if x > d), known[-1])
        lo = max(x for x in known if x < d)
        if hi == lo:
            return costs[hi] * d / hi
        return costs[lo] + (costs[hi] - costs[lo]) * (d - lo) / (hi - lo)

    return generated * costs[0] / sum(cost(d) for d in drafts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--tokens", type=int, default=128, help="new tokens per prompt")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--workloads", default="edit,summary,free,free-sampled")
    p.add_argument("--cost-model", default=None, help="a shape in benchmarks/configs")
    p.add_argument("--cost-tokens", type=int, default=24, help="steps timed per cost round")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"CPU flags: {cpu_flag_summary()}; model: built-in; one stream, greedy; "
        f"{torch.get_num_threads()} thread(s)"
    )
    if args.cost_model:  # first, while the machine's memory holds no other engine
        ds = [0, 1, 2, 4, 8, 16, 24]
        clock = time.process_time if args.threads == 1 else time.perf_counter
        costs = step_costs(args.cost_model, ds, args.cost_tokens, args.rounds, clock)
        what = "CPU" if args.threads == 1 else "wall"
        print(
            f"\n## {args.cost_model} (random weights, fp32): ms ({what} time) per step verifying "
            "d drafts"
        )
        print("| d | " + " | ".join(str(d) for d in ds) + " |")
        print("|---|" + "---|" * len(ds))
        print("| ms | " + " | ".join(f"{costs[d] * 1e3:.1f}" for d in ds) + " |", flush=True)
        gc.collect()
    engines = {m: LLM(None, speculative_config=MODES[m], max_num_seqs=1) for m in modes}
    logs = {m: StepLog(llm) for m, llm in engines.items()}
    results: dict[str, dict[str, Any]] = {}
    for kind in args.workloads.split(","):
        prompts = workload_prompts(kind.removesuffix("-sampled"), args.prompts)
        temperature = 1.0 if kind.endswith("-sampled") else 0.0
        for llm in engines.values():
            timed(llm, prompts[:1], 16)  # warm-up
        runs: dict[str, list[tuple[float, dict[str, float]]]] = {m: [] for m in modes}
        for r in range(args.rounds):
            for m, llm in engines.items():
                logs[m].drafts = []
                runs[m].append(timed(llm, prompts, args.tokens, temperature))
                if r == args.rounds - 1:
                    runs[m][-1][1]["drafts"] = list(logs[m].drafts)  # type: ignore[assignment]
        results[kind] = runs
        base = statistics.median(v[0] for v in runs["off"])
        base_best = max(v[0] for v in runs["off"])
        print(f"\n## {kind} ({len(prompts)} prompts in turn, {args.tokens} tokens each)")
        base_cpu = statistics.median(v[1]["cpu_tps"] for v in runs["off"])
        print(
            "| mode | out tok/s (median) | vs off | vs off (best rounds) | vs off (CPU time) "
            "| accepted | tokens/step |"
        )
        print("|---|---|---|---|---|---|---|")
        for m in modes:
            tps = statistics.median(v[0] for v in runs[m])
            best = max(v[0] for v in runs[m])
            cpu_tps = statistics.median(v[1]["cpu_tps"] for v in runs[m])
            spec = runs[m][-1][1]
            print(
                f"| {m} | {tps:.1f} | {tps / base:.2f}x | {best / base_best:.2f}x | "
                f"{cpu_tps / base_cpu:.2f}x | {spec['acceptance'] * 100:.0f}% | "
                f"{spec['mean_len']:.2f} |"
            )
    if args.cost_model:
        print(f"\n## Projected ratio vs off at {args.cost_model} (built-in run's steps)")
        print("| mode | " + " | ".join(results) + " |")
        print("|---|" + "---|" * len(results))
        for m in modes:
            if m == "off":
                continue
            cells = []
            for runs in results.values():
                spec = runs[m][-1][1]
                cells.append(f"{projected(spec['drafts'], spec['generated'], costs):.2f}x")
            print(f"| {m} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
