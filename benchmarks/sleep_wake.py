"""Time to wake a sleeping engine against a cold start, and the memory sleep hands back.

    python benchmarks/sleep_wake.py [--shape llama-100m] [--dtype float32] [--kv-cache-mib 512]

Builds the shape's model (`benchmarks/configs/<shape>`, random weights: `load_format="dummy"`)
with `enable_sleep_mode=True`, and measures in one process: the engine's start (the "cold
start" here is a second engine built in a warm process, so torch's import is not in it: a
restart of a server costs more), then `sleep(level=1)` (weights to a temporary file, memory
released in place), `wake_up()`, and `sleep(level=2)` (weights discarded). Resident memory is
the process's VmRSS; greedy tokens after waking are checked against those before.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tokenwise import LLM, SamplingParams

REPO = Path(__file__).resolve().parent.parent


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama-100m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-cache-mib", type=int, default=512)
    args = parser.parse_args()
    model = str(REPO / "benchmarks" / "configs" / args.shape)
    settings = dict(
        load_format="dummy",
        dtype=args.dtype,
        kv_cache_memory=args.kv_cache_mib * 2**20,
        skip_tokenizer_init=True,
        enable_sleep_mode=True,
    )
    prompts = [{"prompt_token_ids": list(range(10 + i, 74 + i))} for i in range(4)]
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)

    def tokens(llm: LLM) -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)]

    LLM(model, **settings).shutdown()  # warm the process: imports, kernel builds
    started = time.perf_counter()
    llm = LLM(model, **settings)
    cold_s = time.perf_counter() - started
    before = tokens(llm)
    awake = rss_mib()

    started = time.perf_counter()
    llm.sleep(level=1)
    sleep1_s = time.perf_counter() - started
    asleep1 = rss_mib()
    started = time.perf_counter()
    llm.wake_up()
    wake_s = time.perf_counter() - started
    same = tokens(llm) == before

    started = time.perf_counter()
    llm.sleep(level=2)
    sleep2_s = time.perf_counter() - started
    asleep2 = rss_mib()
    llm.shutdown()

    result = {
        "shape": args.shape,
        "dtype": args.dtype,
        "kv_cache_mib": args.kv_cache_mib,
        "cold_start_s": round(cold_s, 3),
        "sleep1_s": round(sleep1_s, 3),
        "wake1_s": round(wake_s, 3),
        "sleep2_s": round(sleep2_s, 3),
        "rss_awake_mib": round(awake),
        "rss_level1_mib": round(asleep1),
        "rss_level2_mib": round(asleep2),
        "same_tokens_after_wake": same,
    }
    print(
        f"{args.shape} {args.dtype}: cold start {cold_s:.2f} s, wake from level 1 "
        f"{wake_s:.2f} s ({cold_s / wake_s:.1f}x faster); RSS awake {awake:.0f} MiB, "
        f"level 1 {asleep1:.0f} MiB, level 2 {asleep2:.0f} MiB; same tokens: {same}"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
