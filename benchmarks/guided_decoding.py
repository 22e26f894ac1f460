"""Throughput of a batch with half its requests guided by a JSON schema vs none guided.

    python benchmarks/guided_decoding.py [--model PATH] [--num-requests 64] [--max-tokens 96]

Both batches are the same N prompts with the same seeds and budgets, sampled at temperature 1
(the built-in model by default); in the guided one every other request carries a JSON schema
(an object with typed, bounded properties, an enum and an array). The grammar is compiled once
before timing, so the figures are the per-step cost of guidance (the bitmask fill per guided
row and the batched apply) plus the effect of guided replies' lengths, not the compile, which
is reported on its own. Output tokens per second are counted over all N requests; the runs
alternate (none, half, none, half, ...) and the best of each is reported, since a shared
machine's noise only ever slows a run down.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tokenwise.runner.model_runner as model_runner  # noqa: E402
from tokenwise import GuidedDecodingParams, SamplingParams  # noqa: E402
from tokenwise.entrypoints.llm import LLM  # noqa: E402

_MASK_TIME = [0.0]  # seconds spent masking logits (bitmask fill + apply), all steps


def _timed(fn):  # noqa: ANN001, ANN202
    def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _MASK_TIME[0] += time.perf_counter() - start

    return wrapper


model_runner.apply_grammar_bitmask = _timed(model_runner.apply_grammar_bitmask)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "age", "kind", "tags"],
    "additionalProperties": False,
}
PROMPTS = ["def parse(data):\n    return ", "import json\n\nCONFIG = ", "class Pet:\n", "x = "]


def run(llm: LLM, n: int, max_tokens: int, guided_share: bool) -> tuple[int, float]:
    guided = GuidedDecodingParams(json=SCHEMA)
    params = [
        SamplingParams(
            temperature=1.0,
            seed=i,
            max_tokens=max_tokens,
            guided_decoding=guided if guided_share and i % 2 else None,
        )
        for i in range(n)
    ]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
    _MASK_TIME[0] = 0.0
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs), elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: built-in)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    if args.device == "cpu":
        flags = [f for f in ("avx2", "avx512f", "avx512_bf16") if f in open("/proc/cpuinfo").read()]
        print(f"CPU flags: {' '.join(flags)}; torch threads: {torch.get_num_threads()}")
    llm = LLM(args.model, dtype="float32", device=args.device)
    start = time.perf_counter()
    llm.generate(
        "x",
        SamplingParams(max_tokens=1, guided_decoding=GuidedDecodingParams(json=SCHEMA)),
        use_tqdm=False,
    )
    print(f"grammar compile (first guided request, incl. tokenizer info): "
          f"{time.perf_counter() - start:.2f} s")  # fmt: skip
    run(llm, 8, 8, True)  # warm-up
    best: dict[bool, tuple[float, int, float, float]] = {}
    for _ in range(args.repeats):
        for guided in (False, True):
            tokens, elapsed = run(llm, args.num_requests, args.max_tokens, guided)
            rate = tokens / elapsed
            if guided not in best or rate > best[guided][0]:
                best[guided] = (rate, tokens, elapsed, _MASK_TIME[0])
    print(f"{args.num_requests} requests, max_tokens {args.max_tokens}, best of {args.repeats}")
    print("| guided requests | output tokens | time (s) | of which masking (s) | output tok/s |")
    print("|---|---|---|---|---|")
    for guided, label in ((False, "none"), (True, "half (JSON schema)")):
        rate, tokens, elapsed, masking = best[guided]
        print(f"| {label} | {tokens} | {elapsed:.2f} | {masking:.3f} | {rate:.1f} |")
    print(f"half guided / none: {best[True][0] / best[False][0]:.2f}x output tok/s")


if __name__ == "__main__":
    main()
