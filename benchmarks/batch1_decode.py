"""Batch-1 decode with the CPU decode kernels of issue 31 switched off and on, in one run.

    python benchmarks/batch1_decode.py --config llama-100m --dtype bfloat16 [--repeats 3]

One stream, a 256-token prompt and 128 greedy tokens (dummy weights, EOS ignored), timed with
each combination of the small-M linear kernel (`tokenwise.native.gemv`) and the KV-head split
of the decode-attention kernel (`cpu_paged_decode.MIN_KEYS_FOR_HEAD_SPLIT`), the combinations taking
turns so machine noise hits them alike. Prints out tok/s, the ratio to both off, whether the
greedy tokens equal those with both off, and the CPU flags.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenwise import LLM, SamplingParams  # noqa: E402
from tokenwise.model_config import cpu_flag_summary  # noqa: E402
from tokenwise.native import gemv as cpu_gemv  # noqa: E402
from tokenwise.native import paged_decode as cpu_paged_decode  # noqa: E402

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
NEVER = 1 << 40
# name -> (small-M linear kernel on, MIN_KEYS_FOR_HEAD_SPLIT)
MODES = {
    "both off": (False, NEVER),
    "head split": (False, cpu_paged_decode.MIN_KEYS_FOR_HEAD_SPLIT),
    "gemv": (True, NEVER),
    "both": (True, cpu_paged_decode.MIN_KEYS_FOR_HEAD_SPLIT),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="llama-100m", help="a folder of benchmarks/configs")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    llm = LLM(
        os.path.join(CONFIGS, args.config),
        load_format="dummy",
        dtype=args.dtype,
        skip_tokenizer_init=True,
    )
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 4000, (256,), generator=gen).tolist()
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)  # warm-up: kernels built, caches touched
    load = cpu_gemv.load  # cached: switching it off means replacing it, not the variable
    best = dict.fromkeys(MODES, float("inf"))
    tokens: dict[str, list[int]] = {}
    try:
        for _ in range(args.repeats):
            for name, (gemv, split) in MODES.items():
                cpu_gemv.load = load if gemv else (lambda: None)
                cpu_paged_decode.MIN_KEYS_FOR_HEAD_SPLIT = split
                start = time.perf_counter()
                out = llm.generate([prompt], params, use_tqdm=False)
                best[name] = min(best[name], time.perf_counter() - start)
                tokens[name] = out[0].outputs[0].token_ids
    finally:
        cpu_gemv.load = load
    base = best["both off"]
    print(
        f"{args.config} {args.dtype}, batch 1, 256 in / 128 out, best of {args.repeats}; "
        f"CPU flags: {cpu_flag_summary()}"
    )
    print("| kernels | out tok/s | vs both off | greedy tokens |")
    print("|---|---|---|---|")
    for name in MODES:
        same = "equal" if tokens[name] == tokens["both off"] else "differ"
        print(f"| {name} | {128 / best[name]:.1f} | {base / best[name]:.2f}x | {same} |")


if __name__ == "__main__":
    main()
