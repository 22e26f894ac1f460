"""One stream's decode on a GGUF file's Q8_0 / Q4_0 layers with float32 activations kept exact
(`float`) and quantized to int8 per 32 values as llama.cpp does (`int8`), in one run.

    python benchmarks/gguf_activations.py --gguf FILE --tokenizer HF_DIR [--cpu avx2]
        [--rounds 3] [--requests 3]

`TOKENWISE_CPU_QUANT_FP32_ACTIVATIONS` is read once per process, so each mode runs in a
process of its own (`--worker`), the modes taking turns round after round so machine noise hits
them alike. A worker loads the file (float32 activations), decodes `--requests` prompts one at
a time (token-id prompts U[32,384] as `vs_llamacpp.py` sends, 128 greedy tokens, EOS ignored)
and reports its mean time per output token (first token to last) and its tokens.

Prints each mode's median TPOT over the rounds, int8's speed against float's, and how far
int8's greedy tokens follow float's: float is the exact product of the file's dequantized
weights (what transformers computes from the same file), so the first position where a
request's tokens part is what int8 activations cost in agreement. `--cpu avx2` runs the
workers as `vs_llamacpp.py --cpu avx2` runs `tokenwise serve` (AVX2 kernels, `AVX2_ENV`).
The files `vs_llamacpp.py --quant q8_0|q4_0` serves lie in its cache (`models/*/model-q8_0.gguf`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import vs_llamacpp as vs  # noqa: E402

MODES = ("float", "int8")
ENV = "TOKENWISE_CPU_QUANT_FP32_ACTIVATIONS"


def prompts(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(vs.VOCAB_SIZE) for _ in range(rng.randint(*vs.INPUT_LEN))]
        for _ in range(count)
    ]


def worker(args: argparse.Namespace) -> dict:
    """One mode, in this process: mean TPOT (ms) per request and the greedy tokens."""
    from tokenwise import SamplingParams
    from tokenwise.engine.llm_engine import LLMEngine
    from tokenwise.entrypoints.engine_args import build_engine_config

    config = build_engine_config(
        args.gguf, tokenizer=args.tokenizer, dtype="float32", max_model_len=vs.MAX_MODEL_LEN,
        max_num_seqs=1, kv_cache_memory=64 << 20,
    )  # fmt: skip
    engine = LLMEngine(config, "cpu")
    params = SamplingParams(temperature=0.0, max_tokens=vs.OUTPUT_LEN, ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tpots, tokens = [], []
    for i, prompt in enumerate([[5] * 32, *prompts(args.seed, args.requests)]):
        rid = f"r{i}"
        engine.add_request(rid, prompt, params if i else warm)
        stamps: list[float] = []
        ids: list[int] = []
        while engine.has_request(rid):
            for out in engine.step():
                new = out.outputs[0].token_ids if out.outputs else []  # this step's tokens
                ids += new
                stamps += [time.perf_counter()] * len(new)
        if i:  # the first request only warms up (CPU graphs, first-use builds)
            tpots.append((stamps[-1] - stamps[0]) * 1000 / (len(stamps) - 1))
            tokens.append(ids)
    engine.shutdown()
    return {"tpot_ms": statistics.mean(tpots), "tokens": tokens}


def run_worker(args: argparse.Namespace, mode: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--gguf", args.gguf]
    cmd += ["--tokenizer", args.tokenizer, "--requests", str(args.requests)]
    cmd += ["--seed", str(args.seed)]
    env = {**os.environ, ENV: mode, **(vs.AVX2_ENV if args.cpu == "avx2" else {})}
    try:
        done = subprocess.run(
            cmd, env=env, capture_output=True, text=True, timeout=args.timeout, check=False
        )
    except subprocess.TimeoutExpired:
        raise SystemExit(
            f"gguf_activations: the {mode} worker took over {args.timeout} s"
        ) from None
    if done.returncode != 0:
        raise SystemExit(f"gguf_activations: the {mode} worker failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where `a` and `b` differ (None: equal)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", required=True, help="a GGUF file of Q8_0 / Q4_0 matrices")
    p.add_argument("--tokenizer", required=True, help="its Hugging Face tokenizer directory")
    p.add_argument("--cpu", choices=("native", "avx2"), default="native")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=3, help="requests per worker")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800.0, help="per worker, s")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rounds < 1 or args.requests < 1:
        p.error("--rounds and --requests must be at least 1")
    if not os.path.isfile(args.gguf):
        p.error(f"--gguf: no file {args.gguf}")
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    tpots: dict[str, list[float]] = {m: [] for m in MODES}
    tokens: dict[str, list[list[int]]] = {}
    for rnd in range(args.rounds):
        for mode in MODES if rnd % 2 == 0 else MODES[::-1]:
            r = run_worker(args, mode)
            tpots[mode].append(r["tpot_ms"])
            tokens[mode] = r["tokens"]
        print(
            f"round {rnd + 1}: "
            + ", ".join(f"{m} {tpots[m][-1]:.2f} ms" for m in MODES)
            + f", load average {os.getloadavg()[0]:.2f}",
            flush=True,
        )
    base = statistics.median(tpots["float"])
    print(f"\n{os.path.basename(args.gguf)}, float32 activations, one stream, cpu {args.cpu}")
    print(f"{'mode':<8}{'median TPOT (ms)':>18}{'decode tok/s':>14}{'vs float':>10}")
    for mode in MODES:
        tpot = statistics.median(tpots[mode])
        print(f"{mode:<8}{tpot:>18.2f}{1000 / tpot:>14.1f}{base / tpot:>9.2f}x")
    parts = [first_difference(a, b) for a, b in zip(tokens["float"], tokens["int8"], strict=True)]
    print(
        f"int8 against float, greedy tokens of {len(parts)} requests x {vs.OUTPUT_LEN}: first "
        "difference at " + ", ".join("none" if d is None else str(d) for d in parts)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
