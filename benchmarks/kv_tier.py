"""Time to first token of a returning conversation, with the second KV tier and without.

    python benchmarks/kv_tier.py [--config llama-100m] [--turns 8] [--threads N]

Why: a chat returns to its long prefix after the user's think time; by then other requests
have evicted its blocks from the KV cache, and without a second tier every turn prefills the
whole conversation again. With `--kv-offloading-size` the evicted blocks were written to the
tier (files on local disk, on a CPU engine) and the returning turn loads them back instead.

Two engines with the same small KV pool and dummy bf16 weights, one with a disk tier and one
without, take turns: each plays turn k of the same conversation (a `--system`-token opening,
then per turn a `--user`-token message and a `--answer`-token greedy answer, which joins the
history), then `--traffic` unrelated prompts that together overflow the pool, so nothing of the
conversation is left in it. The tier's background writes are flushed between turns (the user's
think time). Printed per returning turn: its prompt length, the time to first token of each
engine (the steps until its first token), the ratio, the tokens the tier served and the time
the tier took in the engine's thread within that turn (copying loaded blocks in, and copies out
of blocks the loads evicted: the reads run on the loader thread); then the tier's hit rate over
the returning turns' prompt tokens, whether both engines generated the same tokens (dummy
weights: near-tied logits, so bf16 rounding of a prefill split differently may flip one;
tests/engine/test_kv_tier.py checks tokens in fp32), and the CPU flags. Last, the overlap: one
more returning turn of the tiered engine arrives while an unrelated request decodes; printed
are the decode steps (and tokens) that request ran while the turn waited for its blocks, and
how long the load took.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenwise import LLM, SamplingParams  # noqa: E402
from tokenwise.engine.request import RequestStatus  # noqa: E402
from tokenwise.model_config import cpu_flag_summary  # noqa: E402

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")


def turn(engine, rid: str, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """Run one request alone: seconds until its first token, and its tokens."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    ttft, tokens = None, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = list(out.outputs[0].token_ids)
        if ttft is None and tokens:
            ttft = time.perf_counter() - start
    assert ttft is not None
    return ttft, tokens


def overlap(engine, prompt: list[int], other: list[int], max_tokens: int) -> str:
    """A returning turn arrives while `other` decodes: what `other` did during the load."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request("busy", {"prompt_token_ids": other}, params)
    busy = engine.groups["busy"][0]
    while not busy.output_token_ids:  # its prefill done: decoding from here on
        engine.step()
    engine.add_request("back", {"prompt_token_ids": prompt}, params)
    back = engine.groups["back"][0]
    loads = engine.kv_tier.loads
    read_before = loads.read_seconds
    start, steps, before = time.perf_counter(), 0, len(busy.output_token_ids)
    waited, during = 0.0, 0
    while engine.has_unfinished_requests():
        engine.step()
        if back.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            steps += 1
            waited = time.perf_counter() - start
            during = len(busy.output_token_ids) - before
    return (
        f"overlap: a returning turn of {len(prompt)} tokens waited {steps} steps "
        f"({waited * 1e3:.0f} ms) for its blocks ({back.num_cached_tokens} tokens cached, read in "
        f"{(loads.read_seconds - read_before) * 1e3:.0f} ms on the loader thread); a decoding "
        f"request produced {during} tokens meanwhile"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="llama-100m", help="a folder of benchmarks/configs")
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--system", type=int, default=512, help="opening prompt tokens")
    parser.add_argument("--user", type=int, default=64, help="tokens of each user message")
    parser.add_argument("--answer", type=int, default=32, help="tokens of each answer")
    parser.add_argument("--traffic", type=int, default=3, help="other prompts between turns")
    parser.add_argument("--blocks", type=int, default=128, help="KV pool blocks (of 16)")
    parser.add_argument("--threads", type=int, default=None, help="default: torch's")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    max_len = args.blocks * 16
    longest = args.system + args.turns * (args.user + args.answer)
    if longest > max_len:
        parser.error(
            f"the conversation reaches {longest} tokens; give --blocks >= {longest // 16 + 1}"
        )
    with open(os.path.join(CONFIGS, args.config, "config.json")) as f:
        config = json.load(f)
    model_dir = tempfile.mkdtemp(prefix="kv-tier-bench-")
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(config, f)
    tier_dir = tempfile.mkdtemp(prefix="kv-tier-files-")
    common = dict(
        load_format="dummy",
        dtype="bfloat16",
        skip_tokenizer_init=True,
        max_model_len=max_len,
        num_gpu_blocks=args.blocks,
    )
    llms = {  # kept referenced: dropping an LLM shuts its engine (and tier) down
        "tier": LLM(model_dir, kv_offloading_size=1.0, kv_offloading_dir=tier_dir, **common),
        "none": LLM(model_dir, **common),
    }
    engines = {name: llm.llm_engine for name, llm in llms.items()}
    gen = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, 4000, (n,), generator=gen).tolist()

    for engine in engines.values():  # warm-up: kernels built
        turn(engine, "warm", tokens(64), 2)
    history = {name: tokens(args.system) for name in engines}
    traffic_len = max_len // args.traffic + 16  # together they overflow the pool
    rows, outputs = [], {name: [] for name in engines}
    for k in range(args.turns):
        message = tokens(args.user)
        times = {}
        for name, engine in engines.items():
            hits = engine.get_stats().prefix_cache_tier_hits
            spent = engine.kv_tier.seconds if engine.kv_tier is not None else 0.0
            prompt = history[name] + message
            times[name], answer = turn(engine, f"turn{k}", prompt, args.answer)
            served = engine.get_stats().prefix_cache_tier_hits - hits
            history[name] = prompt + answer
            outputs[name].append(answer)
            if name == "tier":
                tier_served, tier_s = served, engine.kv_tier.seconds - spent
        rows.append((k + 1, len(prompt), times["tier"], times["none"], tier_served, tier_s))
        others = [tokens(traffic_len) for _ in range(args.traffic)]
        for engine in engines.values():
            for i, other in enumerate(others):
                turn(engine, f"other{k}.{i}", other, 1)
            if engine.kv_tier is not None:
                engine.kv_tier.store.flush(60)

    print(
        f"{args.config}, bf16 dummy weights, a {args.blocks}-block pool (16 tokens each), "
        f"{args.traffic} prompts of {traffic_len} tokens between turns, "
        f"{torch.get_num_threads()} threads; CPU flags: {cpu_flag_summary()}"
    )
    print(
        "| turn | prompt tokens | TTFT, tier | TTFT, no tier | no tier / tier | from tier "
        "| tier's own time |"
    )
    print("|---|---|---|---|---|---|---|")
    for k, n, t_tier, t_none, served, spent in rows:
        print(
            f"| {k} | {n} | {t_tier * 1e3:.0f} ms | {t_none * 1e3:.0f} ms | "
            f"{t_none / t_tier:.2f}x | {served} | {spent * 1e3:.0f} ms |"
        )
    returning = rows[1:]
    asked = sum(r[1] for r in returning)
    served = sum(r[4] for r in returning)
    total_tier = sum(r[2] for r in returning)
    total_none = sum(r[3] for r in returning)
    stats = engines["tier"].kv_tier.store.stats
    print(
        f"returning turns: TTFT {total_tier * 1e3:.0f} ms with the tier, "
        f"{total_none * 1e3:.0f} ms without ({total_none / total_tier:.2f}x); tier hit rate "
        f"{served / asked * 100:.1f}% of their prompt tokens ({served} of {asked}); "
        f"tier files: {stats.stored} written, {stats.bytes_used / 2**20:.1f} MiB, "
        f"{stats.dropped} dropped, {stats.corrupt} corrupt"
    )
    print(f"same generated tokens with and without the tier: {outputs['tier'] == outputs['none']}")
    prompt = history["tier"] + tokens(args.user)
    print(overlap(engines["tier"], prompt, tokens(64), args.answer))


if __name__ == "__main__":
    main()
