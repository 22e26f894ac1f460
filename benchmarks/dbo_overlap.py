"""How much MoE communication latency dual-batch overlap hides (DP=2, expert parallel, CPU).

    python benchmarks/dbo_overlap.py [--delay-ms 5] [--batch 128] [--rounds 10]

Two processes are DP ranks of one Mixtral-shaped MoE model (random weights, experts split
between the ranks) talking over gloo. Every MoE all-gather / reduce-scatter is made to take at
least `--delay-ms` from issue to completion (`TOKENWISE_MOE_COLLECTIVE_DELAY_MS`), a stand-in
for a slow interconnect. Each rank decodes `--batch` requests (one token each per step, so
every step has the same shape), and each step runs in one of three modes:

  (a) unsplit     one batch, no micro-batches
  (b) sequential  two micro-batches one after the other (`TOKENWISE_DBO_SEQUENTIAL=1`)
  (c) dbo         two micro-batches on two threads, each one's exchange under the other's compute

Each mode runs with the delay and without it. The latency a mode *exposes* is the difference
of its two step times; the latency *injected* is the delay times the MoE collectives of a step
(counted); the fraction hidden is 1 - exposed / injected. The exposed latency is measured two
ways: from the step times, and from the time the ranks spend inside the collectives' waits
(less noisy on a shared CPU: another process's burst of compute lengthens a step, but a
wait only insofar as it delays the peer rank). The six (mode, delay) configurations
take turns step by step, in a shuffled order each round (the same on both ranks), so a noisy
neighbour hurts them alike; each figure is the median over rounds. One torch thread per rank.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (enable_microbatching, TOKENWISE_DBO_SEQUENTIAL)
PROMPT_LEN = 8
WARMUP_STEPS = 1  # per mode, after the prefill
MODES = {"unsplit": (False, "0"), "sequential": (True, "1"), "dbo": (True, "0")}
SHAPE = {  # Mixtral-shaped, small enough for a 2-core CPU, big enough for ms of compute
    "hidden_size": 768,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 8192,
    "sliding_window": None,
}


def write_config(out_dir: str) -> str:
    from transformers import MixtralConfig

    MixtralConfig(**SHAPE, architectures=["MixtralForCausalLM"]).save_pretrained(out_dir)
    return out_dir


def _run_rank(rank: int, port: int, path: str, args: argparse.Namespace) -> dict[str, Any]:
    import random

    import torch
    import torch.distributed as dist

    from tokenwise.distributed import get_dp_group, init_dp_group, moe_dispatch
    from tokenwise.engine.llm_engine import LLMEngine
    from tokenwise.entrypoints.llm import build_engine_config
    from tokenwise.sampling.params import SamplingParams

    torch.set_num_threads(1)
    configs = [(mode, delay) for delay in (0.0, args.delay_ms) for mode in MODES]
    max_tokens = 1 + WARMUP_STEPS * len(MODES) + args.rounds * len(configs) + 2
    config = build_engine_config(
        path,
        dtype="float32",
        load_format="dummy",
        skip_tokenizer_init=True,
        data_parallel_size=2,
        enable_expert_parallel=True,
        enable_dbo=True,
        microbatching_token_threshold=2,
        enable_prefix_caching=False,
        max_num_seqs=args.batch,
        max_num_batched_tokens=max(2048, args.batch * PROMPT_LEN),
        max_model_len=PROMPT_LEN + max_tokens + 16,
        num_gpu_blocks=args.batch * ((PROMPT_LEN + max_tokens) // 16 + 1) + 4,
    )
    config.parallel.data_parallel_rank = rank
    init_dp_group(config.parallel, "127.0.0.1", port, 120.0, "cpu")
    engine = LLMEngine(config, "cpu")
    issued = [0]
    issue = moe_dispatch._issued_then_waited

    def counting(work: Any, what: str, on_cpu: bool) -> None:
        issued[0] += 1
        issue(work, what, on_cpu)

    moe_dispatch._issued_then_waited = counting
    waited = [0.0]  # seconds inside the MoE collectives' waits (where the delay shows up)
    wait = moe_dispatch.wait_collective

    def timed_wait(work: Any, issued_at: float, what: str, on_cpu: bool) -> None:
        start = time.perf_counter()
        wait(work, issued_at, what, on_cpu)
        waited[0] += time.perf_counter() - start

    moe_dispatch.wait_collective = timed_wait
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    g = torch.Generator().manual_seed(rank)
    for i in range(args.batch):
        prompt = torch.randint(3, SHAPE["vocab_size"], (PROMPT_LEN,), generator=g).tolist()
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)

    def step(mode: str, delay: float) -> tuple[float, float]:
        config.parallel.enable_microbatching = MODES[mode][0]
        os.environ["TOKENWISE_DBO_SEQUENTIAL"] = MODES[mode][1]
        os.environ["TOKENWISE_MOE_COLLECTIVE_DELAY_MS"] = str(delay)
        flags = torch.ones(1, dtype=torch.int32)
        dist.all_reduce(flags, group=get_dp_group())  # the ranks start each step together
        start, waited_before = time.perf_counter(), waited[0]
        engine.step()
        return time.perf_counter() - start, waited[0] - waited_before

    step("unsplit", 0.0)  # the prefill
    for _ in range(WARMUP_STEPS):
        for mode in MODES:
            step(mode, 0.0)
    times: dict[tuple[str, float], list[float]] = {c: [] for c in configs}
    waits: dict[tuple[str, float], list[float]] = {c: [] for c in configs}
    collectives: dict[str, int] = {}
    order = random.Random(0)  # the same on both ranks: their collectives must pair up
    for _ in range(args.rounds):
        order.shuffle(configs)
        for mode, delay in configs:
            before, split = issued[0], engine.runner.num_ubatched_steps
            step_s, wait_s = step(mode, delay)
            times[(mode, delay)].append(step_s)
            waits[(mode, delay)].append(wait_s)
            if (engine.runner.num_ubatched_steps > split) != MODES[mode][0]:
                raise RuntimeError(f"a {mode} step was {'not ' * MODES[mode][0]}split")
            collectives[mode] = issued[0] - before
    return {
        "times": {k: statistics.median(v) for k, v in times.items()},
        "waits": {k: statistics.median(v) for k, v in waits.items()},
        "collectives": collectives,
    }


def run_rank(rank: int, port: int, path: str, args: argparse.Namespace, results: Any) -> None:
    try:
        results.put((rank, _run_rank(rank, port, path, args)))
    except BaseException:
        results.put((rank, {"error": traceback.format_exc()}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--delay-ms", type=float, default=5.0)
    parser.add_argument("--batch", type=int, default=128, help="decoding requests per rank")
    parser.add_argument("--rounds", type=int, default=10, help="timed steps per configuration")
    args = parser.parse_args()

    from tokenwise.distributed.tp_state import free_port

    ctx = mp.get_context("spawn")
    results: Any = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        path = write_config(tmp)
        port = free_port()
        procs = [
            ctx.Process(target=run_rank, args=(r, port, path, args, results), daemon=True)
            for r in range(2)
        ]
        for p in procs:
            p.start()
        got: dict[int, Any] = {}
        deadline = time.monotonic() + 1800
        while len(got) < 2:
            if time.monotonic() > deadline:
                raise SystemExit("ranks timed out")
            try:
                rank, report = results.get(timeout=5)
                got[rank] = report
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise SystemExit("a rank died") from None
        for p in procs:
            p.join(timeout=10)
    for rank, report in got.items():
        if "error" in report:
            raise SystemExit(f"rank {rank}:\n{report['error']}")
    report_table(got, args)


def report_table(got: dict[int, Any], args: argparse.Namespace) -> None:
    """One row per mode; figures are the mean of the two ranks' medians."""

    def mean(key: str, config: tuple[str, float]) -> float:
        return sum(r[key][config] for r in got.values()) / len(got) * 1e3

    counts = got[0]["collectives"]
    print(
        f"DP=2 EP over gloo, Mixtral shape {SHAPE['num_hidden_layers']} layers x "
        f"{SHAPE['num_local_experts']} experts, hidden {SHAPE['hidden_size']}, "
        f"decode of {args.batch} requests/rank, delay {args.delay_ms:g} ms per MoE collective, "
        f"median of {args.rounds} steps"
    )
    print(
        "| mode | collectives/step | injected (ms) | step, no delay (ms) | step, delayed (ms) "
        "| hidden (step time) | waits, no delay (ms) | waits, delayed (ms) | hidden (waits) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for mode in MODES:
        injected = counts[mode] * args.delay_ms
        t0, t1 = mean("times", (mode, 0.0)), mean("times", (mode, args.delay_ms))
        w0, w1 = mean("waits", (mode, 0.0)), mean("waits", (mode, args.delay_ms))
        print(
            f"| {mode} | {counts[mode]} | {injected:.0f} | {t0:.1f} | {t1:.1f} | "
            f"{1 - (t1 - t0) / injected:.0%} | {w0:.1f} | {w1:.1f} | "
            f"{1 - (w1 - w0) / injected:.0%} |"
        )


if __name__ == "__main__":
    main()
