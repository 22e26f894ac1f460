"""Speculative decoding measured end to end at the Qwen3-0.6B shape, with a copying model's
acceptance forced onto random weights.

    python benchmarks/spec_forced.py [--shape qwen3-0.6b] [--prompts 2] [--rounds 2]
        [--tokens 96] [--modes off,ngram,suffix-7,suffix] [--workloads edit,summary,...]
    python benchmarks/spec_forced.py --costs [--ds 0,1,2,4,8,16]

A random-weight 0.6B model does not copy its prompt, so its drafts are never accepted and
speculation can only lose there. What is real and what is not, here:

- real: the shape's whole forward on every step (28 layers, fp32 random weights, the LM head
  over 151936 tokens), the proposers (n-gram, suffix) over the real token history, the
  per-request draft budget, verification (`rejection.verify`) and the engine loop, one stream,
  wall clock, every mode taking turns round after round on one engine (its drafter swapped
  per mode, `drafters`; "off" has none, so it runs plain decode steps);
- forced: which token the model emits. The built-in model (4M parameters, trained on Python:
  the only model here that writes code) first writes each workload's text
  (`spec_workloads.py`'s edit / summary / free prompts, greedy; free-sampled at temperature 1);
  then, at the 0.6B shape, each logit row is set to -inf except for the token the built-in
  model wrote at that position (`ForcedTrace`, wrapped around the runner's `sample_step`,
  the same for every mode). So the 0.6B engine writes that text, and accepts exactly the drafts
  a model writing it would accept: acceptance is the built-in model's, cost is the 0.6B shape's.

Every mode's output is checked to be the trace, token for token. `--costs` instead times the
shape's decode step and its steps verifying `d` drafts (a proposer that always proposes `d`),
with verification under CPU graphs (`runner/verify_rows.graph_query_len`) and without (the
eager path verification took before), taking turns on one engine. CPU flags and the load
average are printed with the figures: on a shared machine read ratios, not absolute speeds.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.spec_workloads import _Fixed, workload_prompts  # noqa: E402
from tokenwise import LLM, SamplingParams  # noqa: E402
from tokenwise.config import CUDAGraphMode, SpeculativeConfig  # noqa: E402
from tokenwise.engine.drafter import Drafter  # noqa: E402
from tokenwise.model_config import cpu_flag_summary  # noqa: E402
from tokenwise.runner import model_runner  # noqa: E402

CONFIGS = Path(__file__).resolve().parent / "configs"
MODES: dict[str, dict[str, Any] | None] = {
    "off": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 7, "prompt_lookup_max": 4},
    # 7 drafts: a verifying step of 8 rows, the largest CPU graph (CPU_MAX_CAPTURE_SIZE).
    "suffix-7": {"method": "suffix", "num_speculative_tokens": 7},
    "suffix": {"method": "suffix"},  # vLLM's defaults: up to 24 drafts, eager past 7
}


class ForcedTrace:
    """Wraps the runner's `sample_step`: each logit row of a request whose prompt has a trace
    keeps only the trace's token at that row's position (-inf elsewhere), so greedy decoding
    and verification (one row per draft position) both emit the trace."""

    def __init__(self, sample_step: Any, traces: dict[tuple[Any, ...], list[int]]) -> None:
        self.sample_step = sample_step
        self.traces = traces

    def __call__(
        self, sampler: Any, logits: torch.Tensor, sampled: Any, states: Any, *rest: Any
    ) -> Any:
        row = 0
        for s, st in zip(sampled, states, strict=True):
            trace = self.traces.get((st.sampling_params.temperature, *st.prompt_token_ids))
            done = len(st.output_token_ids)
            for j in range(len(s.spec_token_ids) + 1):
                if trace is not None and done + j < len(trace):
                    logits[row].fill_(float("-inf"))
                    logits[row, trace[done + j]] = 0.0
                row += 1
        return self.sample_step(sampler, logits, sampled, states, *rest)


def record_traces(
    workloads: list[str], prompts: int, tokens: int
) -> dict[str, list[tuple[list[int], list[int], float]]]:
    """Per workload: (prompt token ids, the built-in model's text, temperature) per prompt."""
    llm = LLM(None, max_num_seqs=1)
    out: dict[str, list[tuple[list[int], list[int], float]]] = {}
    for kind in workloads:
        temperature = 1.0 if kind.endswith("-sampled") else 0.0
        params = SamplingParams(temperature=temperature, seed=0, max_tokens=tokens, ignore_eos=True)
        texts = workload_prompts(kind.removesuffix("-sampled"), prompts)
        outs = llm.generate(texts, params, use_tqdm=False)
        out[kind] = [
            (list(o.prompt_token_ids), list(o.outputs[0].token_ids), temperature) for o in outs
        ]
    llm.llm_engine.shutdown()
    return out


def shape_engine(shape: str, spec: dict[str, Any] | None) -> LLM:
    """One stream of `shape` with random fp32 weights."""
    return LLM(
        str(CONFIGS / shape),
        load_format="dummy",
        dtype="float32",
        skip_tokenizer_init=True,
        speculative_config=spec,
        max_num_seqs=1,
        max_model_len=1024,  # not the shape's 40960: the 256 MiB cache holds it
        kv_cache_memory=256 << 20,
    )


class StepCounter:
    """Counts a runner's verifying steps and those that replayed a FULL graph."""

    def __init__(self, llm: LLM) -> None:
        self.verify = self.graphed = 0
        runner = llm.llm_engine.runner
        execute = runner.execute_model

        def counted(sched: Any) -> Any:
            out = execute(sched)
            if any(s.spec_token_ids for s in sched.scheduled):
                self.verify += 1
                self.graphed += runner.last_graph[0] == CUDAGraphMode.FULL
            return out

        runner.execute_model = counted  # type: ignore[method-assign]


def run_once(llm: LLM, traces: list[tuple[list[int], list[int], float]]) -> dict[str, float]:
    """One pass over the workload's prompts: out tok/s (wall clock) and speculation figures."""
    stats = llm.llm_engine.get_stats()
    before = (
        stats.spec_decode_num_drafts,
        stats.spec_decode_num_draft_tokens,
        stats.spec_decode_num_accepted_tokens,
    )
    generated, elapsed = 0, 0.0
    for prompt, trace, temperature in traces:
        params = SamplingParams(
            temperature=temperature, seed=0, max_tokens=len(trace), ignore_eos=True
        )
        start = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        elapsed += time.perf_counter() - start
        got = list(out[0].outputs[0].token_ids)
        if got != trace:
            raise AssertionError(f"the forced run wrote {got[:8]}..., not the trace {trace[:8]}...")
        generated += len(got)
    stats = llm.llm_engine.get_stats()
    steps = stats.spec_decode_num_drafts - before[0]
    proposed = stats.spec_decode_num_draft_tokens - before[1]
    accepted = stats.spec_decode_num_accepted_tokens - before[2]
    return {
        "tps": generated / elapsed,
        "acceptance": accepted / proposed if proposed else 0.0,
        "mean_len": 1 + accepted / steps if steps else 1.0,
    }


def drafters(llm: LLM, modes: list[str]) -> dict[str, Drafter | None]:
    """Each mode's drafter for the one engine (None: no speculation). The engine is built with
    suffix decoding at its default 24 drafts; the other modes' drafters are made from their
    own settings and swapped in, so the modes share one copy of the weights (each engine of
    the 0.6B shape holds ~5 GB in fp32) and the scheduler, runner and graphs stay the same."""
    engine = llm.llm_engine
    out: dict[str, Drafter | None] = {}
    for m in modes:
        spec = MODES[m]
        if spec is None:
            out[m] = None
        elif spec == MODES["suffix"]:
            out[m] = engine.drafter
        else:
            config = SpeculativeConfig.from_dict(spec)
            out[m] = Drafter(config, engine.config.model.max_model_len)
    return out


def end_to_end(args: argparse.Namespace) -> None:
    workloads = args.workloads.split(",")
    traces = record_traces(workloads, args.prompts, args.tokens)
    gc.collect()
    modes = args.modes.split(",")
    llm = shape_engine(args.shape, MODES["suffix"])
    engine = llm.llm_engine
    by_mode = drafters(llm, modes)
    counter = StepCounter(llm)
    model_runner.sample_step = ForcedTrace(  # type: ignore[assignment]
        model_runner.sample_step,  # free and free-sampled share prompts: keyed by temperature too
        {(temp, *p): t for runs in traces.values() for p, t, temp in runs},
    )
    first = next(iter(traces.values()))[0]
    for drafter in by_mode.values():  # warm-up: kernels built, graphs replayed once
        engine.drafter = drafter
        run_once(llm, [(first[0], first[1][:8], first[2])])
    for kind in workloads:
        load = os.getloadavg()[0]
        runs: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
        graphed: dict[str, list[int]] = {m: [0, 0] for m in modes}
        for _ in range(args.rounds):
            for m, drafter in by_mode.items():
                engine.drafter = drafter
                counter.verify = counter.graphed = 0
                runs[m].append(run_once(llm, traces[kind]))
                graphed[m][0] += counter.graphed
                graphed[m][1] += counter.verify
        base = statistics.median(r["tps"] for r in runs["off"])
        base_best = max(r["tps"] for r in runs["off"])
        print(
            f"\n## {kind} ({args.prompts} prompts in turn, {args.tokens} tokens each; load "
            f"average {load:.1f} -> {os.getloadavg()[0]:.1f})"
        )
        print(
            "| mode | out tok/s (median) | vs off | vs off (best rounds) | accepted "
            "| tokens/step | verify steps on a graph |"
        )
        print("|---|---|---|---|---|---|---|")
        for m in modes:
            tps = statistics.median(r["tps"] for r in runs[m])
            best = max(r["tps"] for r in runs[m])
            last, (on_graph, verify) = runs[m][-1], graphed[m]
            print(
                f"| {m} | {tps:.2f} | {tps / base:.2f}x | {best / base_best:.2f}x | "
                f"{last['acceptance'] * 100:.0f}% | {last['mean_len']:.2f} | "
                f"{f'{on_graph}/{verify}' if verify else '-'} |",
                flush=True,
            )


def costs(args: argparse.Namespace) -> None:
    """Per-step cost of verifying `d` drafts, verification on graphs and eager, in turns, on
    one engine: "eager" clears the runner's verify setting (`_verify_query_len`), which keeps
    every verifying step off the graphs, as before they could replay them."""
    ds = [int(d) for d in args.ds.split(",")]
    llm = shape_engine(args.shape, {"method": "suffix", "num_speculative_tokens": max(ds)})
    runner = llm.llm_engine.runner
    verify_len = {"graph": runner._verify_query_len, "eager": None}
    drafter = llm.llm_engine.drafter
    assert drafter is not None
    fixed = drafter.suffix = _Fixed()  # type: ignore[assignment]
    drafter.budget.limit = lambda rid: fixed.d  # type: ignore[method-assign]
    prompt = {"prompt_token_ids": list(range(3, 35))}
    params = SamplingParams(temperature=0.0, max_tokens=args.cost_tokens, ignore_eos=True)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    best: dict[tuple[str, int], float] = {}
    load = os.getloadavg()[0]
    # One thread: CPU time, which other processes on a shared machine disturb least.
    clock = time.process_time if torch.get_num_threads() == 1 else time.perf_counter
    for r in range(args.rounds + 1):  # the first round warms up
        for d in ds:
            for name, value in verify_len.items():
                runner._verify_query_len = value
                fixed.d = d
                start = clock()
                llm.generate([prompt], one, use_tqdm=False)
                prefill = clock() - start
                steps = llm.llm_engine.get_stats().num_steps_total
                start = clock()
                llm.generate([prompt], params, use_tqdm=False)
                elapsed = clock() - start - prefill
                steps = llm.llm_engine.get_stats().num_steps_total - steps - 1
                if r:
                    key = (name, d)
                    best[key] = min(best.get(key, float("inf")), elapsed / steps)
    print(
        f"\n## {args.shape} (random weights, fp32, {torch.get_num_threads()} threads): ms "
        f"({'CPU' if clock is time.process_time else 'wall'} time) per "
        f"step verifying d drafts, fastest of {args.rounds} rounds (load average {load:.1f} -> "
        f"{os.getloadavg()[0]:.1f})"
    )
    print("| verification | " + " | ".join(f"d={d}" for d in ds) + " |")
    print("|---|" + "---|" * len(ds))
    for name in verify_len:
        decode = best[(name, 0)]
        cells = [f"{best[(name, d)] * 1e3:.1f} ({best[(name, d)] / decode:.2f}x)" for d in ds]
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen3-0.6b", help="a folder of benchmarks/configs")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--tokens", type=int, default=96, help="new tokens per prompt")
    p.add_argument("--modes", default="off,ngram,suffix-7,suffix")
    p.add_argument("--workloads", default="edit,summary,free,free-sampled")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    p.add_argument("--costs", action="store_true", help="time verifying steps instead")
    p.add_argument("--ds", default="0,1,2,4,8,16", help="draft counts --costs times")
    p.add_argument("--cost-tokens", type=int, default=16, help="steps timed per cost round")
    args = p.parse_args(argv)
    for m in args.modes.split(","):
        if m not in MODES:
            p.error(f"--modes: unknown mode {m!r} (choose from {', '.join(MODES)})")
    if "off" not in args.modes.split(","):
        p.error("--modes must include off (the ratios are to it)")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"CPU flags: {cpu_flag_summary()}; shape: {args.shape}; {torch.get_num_threads()} "
        f"thread(s); env: TOKENWISE_CPU_MARCH={os.environ.get('TOKENWISE_CPU_MARCH', '-')} "
        f"ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY', '-')}"
    )
    if args.costs:
        costs(args)
    else:
        end_to_end(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
