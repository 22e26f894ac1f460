"""Speculative decoding (n-gram prompt lookup, or a draft model) against plain decoding.

    python benchmarks/spec_decode.py [--model DIR] [--k 2,4,8] [--streams 1,2,4,8,16,32]
    python benchmarks/spec_decode.py --draft DIR [--k 2,4] [--workload fresh] [--streams ""]

The workload is repetitive, as in code editing: each prompt is a function from the Python
standard library (what the built-in model was trained on), a blank line, and the function's
first lines again, so a model that copies continues with text the prompt already holds. Greedy,
128 new tokens, EOS ignored.

1. One stream: every prompt in turn, without speculation and with `k` drafts per step for each
   `--k`: out tok/s, the ratio to no speculation, the acceptance rate (accepted / proposed
   drafts) and the mean acceptance length (tokens per verifying step, 1 + accepted / steps).
2. Several streams: the same prompts `--streams` at a time, with and without the best `k`
   (`disable_by_batch_size` off, so every step speculates): where the ratio falls below 1 is
   where speculation stops paying, which is what `disable_by_batch_size` should be.

`--eagle DIR` / `--eagle3 DIR` add "eagle k=..." / "eagle3 k=..." rows for an EAGLE head of
the target (the published layouts; see `tokenwise/spec_decode/eagle.py`). Speed with an
untrained head means nothing without its acceptance, printed beside it.

With `--draft DIR` (a checkpoint with the target's tokenizer, e.g. one trained by
`tools/train_default_model.py --tokenizer tokenwise/models_data/default`), the one-stream table
also has a "draft k=..." row per `--k`: the draft model proposes greedily. `--workload fresh`
prompts with the functions' first lines only, so the model writes code the prompt does not
hold (where prompt lookup has little to copy and a draft model has to predict). `--streams ""`
skips part 2. `--costs` also times each kind of step over one more pass of the one-stream
prompts (the fastest and the median: on a shared machine the fastest is the least disturbed).

Modes take turns round after round (`--rounds`) so machine noise hits them alike; the median
round is printed. The CPU flags are printed with the figures.
"""

from __future__ import annotations

import argparse
import ast
import copy
import os
import statistics
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenwise import LLM, SamplingParams  # noqa: E402
from tokenwise.model_config import cpu_flag_summary  # noqa: E402

OUTPUT_LEN = 128


def stdlib_functions(count: int, min_lines: int = 12, max_lines: int = 40) -> list[str]:
    """Source of `count` top-level functions from the standard library, in a fixed order."""
    found: list[str] = []
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.glob("*.py")):
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError):
            continue
        lines = source.splitlines()
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.end_lineno is not None:
                span = node.end_lineno - node.lineno + 1
                if min_lines <= span <= max_lines:
                    found.append("\n".join(lines[node.lineno - 1 : node.end_lineno]))
                    break  # one per file: varied code
        if len(found) == count:
            break
    return found


def repeat_prompts(count: int, head_lines: int = 3) -> list[str]:
    """Each function, a blank line, then its first `head_lines` lines again."""
    return [
        f"{code}\n\n\n" + "\n".join(code.splitlines()[:head_lines]) + "\n"
        for code in stdlib_functions(count)
    ]


def fresh_prompts(count: int, head_lines: int = 3) -> list[str]:
    """Each function's first `head_lines` lines only: the rest is for the model to write."""
    return ["\n".join(code.splitlines()[:head_lines]) + "\n" for code in stdlib_functions(count)]


def build(
    model: str | None,
    k: int,
    threshold: int | None,
    max_num_seqs: int,
    draft: str | None = None,
    method: str = "draft_model",
) -> LLM:
    spec: dict[str, Any] | None = None
    if k and draft is not None:
        spec = {"method": method, "model": draft, "num_speculative_tokens": k}
    elif k:
        spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4}
    if spec is not None:
        spec["disable_by_batch_size"] = threshold
    return LLM(model, speculative_config=spec, max_num_seqs=max_num_seqs)


def timed(llm: LLM, prompts: list[str], streams: int) -> tuple[float, dict[str, float]]:
    """Out tok/s over `prompts`, `streams` at a time, and the speculation figures of the run."""
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    before = copy.deepcopy(llm.llm_engine.get_stats())  # the engine updates it in place
    start = time.perf_counter()
    generated = 0
    for i in range(0, len(prompts), streams):
        outs = llm.generate(prompts[i : i + streams], params, use_tqdm=False)
        generated += sum(len(o.outputs[0].token_ids) for o in outs)
    elapsed = time.perf_counter() - start
    after = llm.llm_engine.get_stats()
    steps = after.spec_decode_num_drafts - before.spec_decode_num_drafts
    proposed = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    spec = {
        "acceptance": accepted / proposed if proposed else 0.0,
        "mean_len": 1 + accepted / steps if steps else 1.0,
    }
    return generated / elapsed, spec


def step_costs(llm: LLM, prompts: list[str]) -> str:
    """Fastest and median milliseconds of the target's decode and verifying steps and of the
    draft model's passes over one run of `prompts`: what decides whether speculation pays
    (a verifying step emitting `L` tokens on average must cost less than `L` decode steps,
    the draft's passes included). The fastest is the figure least disturbed by other load."""
    engine = llm.llm_engine
    steps: list[tuple[float, int]] = []
    passes: list[tuple[float, int]] = []

    def timing(fn: Any, into: list[tuple[float, int]], size: Any) -> Any:
        def wrapped(arg: Any, *rest: Any) -> Any:
            start = time.perf_counter()
            out = fn(arg, *rest)
            into.append((time.perf_counter() - start, size(arg)))
            return out

        return wrapped

    runner = engine.runner

    def kind(step: Any) -> int:  # 1: a decode step, 2: a verifying one, 0: with a prefill
        if any(x.spec_token_ids for x in step.scheduled):
            return 2
        return 1 if all(x.num_new_tokens == 1 for x in step.scheduled) else 0

    runner.execute_model = timing(runner.execute_model, steps, kind)  # type: ignore[method-assign]
    draft = engine.drafter.draft_model if engine.drafter is not None else None
    if draft is not None:  # an EAGLE head's passes are `run_head`, a draft model's `run`
        name = "run_head" if hasattr(draft.runner, "run_head") else "run"
        setattr(
            draft.runner,
            name,
            timing(
                getattr(draft.runner, name), passes, lambda seqs: max(len(q.tokens) for q in seqs)
            ),
        )
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    for prompt in prompts:
        llm.generate([prompt], params, use_tqdm=False)

    def ms(values: list[tuple[float, int]], lo: int, hi: int) -> str:
        picked = [t * 1e3 for t, n in values if lo <= n <= hi]
        if not picked:
            return "-"
        return f"{min(picked):.2f} / {statistics.median(picked):.2f}"

    return f"| {ms(steps, 1, 1)} | {ms(steps, 2, 2)} | {ms(passes, 1, 1)} | {ms(passes, 2, 16)} |"


def rounds(
    engines: dict[str, LLM], prompts: list[str], streams: int, n: int
) -> dict[str, tuple[float, dict[str, float]]]:
    """Per mode: the median round's out tok/s and the last round's speculation figures, plus
    the best round's tok/s (as `spec["best"]`): on a shared machine other processes only ever
    slow a round down, so the best round is the least disturbed one."""
    runs: dict[str, list[tuple[float, dict[str, float]]]] = {name: [] for name in engines}
    for _ in range(n):
        for name, llm in engines.items():
            runs[name].append(timed(llm, prompts, streams))
    result = {}
    for name, values in runs.items():
        median = statistics.median(v[0] for v in values)
        result[name] = (median, {**values[-1][1], "best": max(v[0] for v in values)})
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: built-in)")
    p.add_argument("--k", default="2,4,8", help="drafts per step to compare")
    p.add_argument("--streams", default="1,2,4,8,16,32")
    p.add_argument("--prompts", type=int, default=8, help="prompts in the one-stream part")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--draft", default=None, help="also a draft model (checkpoint directory)")
    p.add_argument("--eagle", default=None, help="also an EAGLE-1 head (checkpoint directory)")
    p.add_argument("--eagle3", default=None, help="also an EAGLE-3 head (checkpoint directory)")
    p.add_argument("--workload", choices=["repeat", "fresh"], default="repeat")
    p.add_argument("--costs", action="store_true", help="also time each kind of step")
    args = p.parse_args(argv)
    ks = [int(x) for x in args.k.split(",")]
    print(
        f"CPU flags: {cpu_flag_summary()}; model: {args.model or 'built-in'}; "
        f"draft: {args.draft or '-'}; workload: {args.workload}"
    )

    prompts = repeat_prompts if args.workload == "repeat" else fresh_prompts
    one = prompts(args.prompts)
    engines = {"off": build(args.model, 0, None, 1)}
    engines.update({f"k={k}": build(args.model, k, None, 1) for k in ks})
    if args.draft is not None:
        engines.update({f"draft k={k}": build(args.model, k, None, 1, args.draft) for k in ks})
    for method in ("eagle", "eagle3"):  # a random head's speed says little: read its acceptance
        head = getattr(args, method)
        if head is not None:
            engines.update(
                {f"{method} k={k}": build(args.model, k, None, 1, head, method) for k in ks}
            )
    for llm in engines.values():
        timed(llm, one[:1], 1)  # warm-up
    result = rounds(engines, one, 1, args.rounds)
    base, base_best = result["off"][0], result["off"][1]["best"]
    print(f"\n## One stream ({len(one)} prompts in turn, {OUTPUT_LEN} tokens each)")
    print(
        "| mode | out tok/s (median) | vs off | best round | vs off (best) | acceptance rate "
        "| mean acceptance length |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, (tps, spec) in result.items():
        print(
            f"| {name} | {tps:.1f} | {tps / base:.2f}x | {spec['best']:.1f} | "
            f"{spec['best'] / base_best:.2f}x | {spec['acceptance'] * 100:.1f}% | "
            f"{spec['mean_len']:.2f} |"
        )
    best = max(ks, key=lambda k: result[f"k={k}"][0])
    if args.costs:
        print("\n## Step costs, ms (fastest / median), one stream")
        print(
            "| mode | decode step | verifying step | draft pass, 1 token a sequence | "
            "draft pass, 2+ tokens (catch-up) |"
        )
        print("|---|---|---|---|---|")
        for name, llm in engines.items():
            print(f"| {name} {step_costs(llm, one)}")

    if not args.streams:
        return 0
    streams = [int(x) for x in args.streams.split(",")]
    many = prompts(max(streams))
    print(f"\n## Streams at once, k={best} against off (speculating at every batch size)")
    print("| streams | off out tok/s | k out tok/s | ratio |")
    print("|---|---|---|---|")
    stop_at = None
    for n in streams:
        pair: dict[str, Any] = {
            "off": build(args.model, 0, None, n),
            "on": build(args.model, best, None, n),
        }
        for llm in pair.values():
            timed(llm, many[:n], n)
        res = rounds(pair, many[:n], n, args.rounds)
        ratio = res["on"][0] / res["off"][0]
        if ratio < 1.0 and stop_at is None:
            stop_at = n
        print(f"| {n} | {res['off'][0]:.1f} | {res['on'][0]:.1f} | {ratio:.2f}x |")
        del pair
    where = f"{stop_at} streams" if stop_at else "none of the batch sizes measured"
    print(f"\nspeculation stopped paying at: {where}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
