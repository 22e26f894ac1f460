"""One-stream decode over a long context with a bf16 KV cache and an fp8 one, in one run.

    python benchmarks/kv_cache_fp8.py [--config llama-100m] [--context 3072] [--repeats 3]
        [--threads N]

Why: at batch 1 every decode step reads the whole KV cache, so on a CPU an fp8 cache (one byte
per element instead of two) can pay where attention is a visible part of the step, i.e. with
a long context. Two engines, bf16 weights (dummy), the same prompt of `--context` tokens and
64 greedy tokens, taking turns so machine noise hits them alike; printed: tok/s of each, the
ratio, whether the greedy tokens agree, the KV capacity each gets from the same memory, the
decode-attention kernel alone on one layer's cache at that length, and the CPU flags.
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
from tokenwise.attention.backends import cpu_kernels  # noqa: E402
from tokenwise.attention.backends.kv_quant import quantize  # noqa: E402
from tokenwise.model_config import cpu_flag_summary  # noqa: E402

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
CACHES = ("auto", "fp8")  # auto = the weights' bf16
OUT_TOKENS = 64


def kernel_alone(context: int, heads: int, head_size: int, repeats: int) -> dict[str, float]:
    """Microseconds per call of the C decode kernel, one sequence of `context` keys."""
    lib = cpu_kernels.load()
    if lib is None:
        return {}
    block = 16
    blocks = -(-context // block)
    shape = (blocks, block, heads, head_size)
    q = torch.randn(1, heads, head_size)
    out = torch.empty_like(q)
    table = torch.randperm(blocks, dtype=torch.int32)[None]
    lens, first = torch.tensor([context], dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    times = {}
    for name, dtype in [("bf16", torch.bfloat16), ("fp8_e4m3", torch.float8_e4m3fn)]:
        k = quantize(torch.randn(shape), dtype, 1.0)
        v = quantize(torch.randn(shape), dtype, 1.0)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(50):
                cpu_kernels.paged_decode(lib, q, k, v, table, lens, first, None, 0.125, out)
            best = min(best, (time.perf_counter() - start) / 50)
        times[name] = best * 1e6
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="llama-100m", help="a folder of benchmarks/configs")
    parser.add_argument("--context", type=int, default=3072, help="prompt tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv-cache-memory", type=int, default=256 << 20)
    parser.add_argument("--threads", type=int, default=None, help="default: torch's")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    # The shape's config with room for the context (RoPE extends; the weights are dummy).
    with open(os.path.join(CONFIGS, args.config, "config.json")) as f:
        config = json.load(f)
    config["max_position_embeddings"] = max(config["max_position_embeddings"], 8192)
    model_dir = tempfile.mkdtemp(prefix="kv-fp8-bench-")
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(config, f)
    llms = {
        cache: LLM(
            model_dir,
            load_format="dummy",
            dtype="bfloat16",
            skip_tokenizer_init=True,
            max_model_len=args.context + OUT_TOKENS,
            kv_cache_memory=args.kv_cache_memory,
            kv_cache_dtype=cache,
            enable_prefix_caching=False,
        )
        for cache in CACHES
    }
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 4000, (args.context,), generator=gen).tolist()
    decode = SamplingParams(temperature=0, max_tokens=OUT_TOKENS, ignore_eos=True)
    prefill = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    best = dict.fromkeys(CACHES, float("inf"))
    tokens: dict[str, list[int]] = {}
    for llm in llms.values():  # warm-up: kernels built, caches touched
        llm.generate([prompt], prefill, use_tqdm=False)
    for _ in range(args.repeats):
        for cache, llm in llms.items():
            # Decode time alone: the run with 64 tokens minus the prefill with one.
            start = time.perf_counter()
            llm.generate([prompt], prefill, use_tqdm=False)
            prefill_s = time.perf_counter() - start
            start = time.perf_counter()
            out = llm.generate([prompt], decode, use_tqdm=False)
            best[cache] = min(best[cache], time.perf_counter() - start - prefill_s)
            tokens[cache] = out[0].outputs[0].token_ids
    base = best["auto"]
    print(
        f"{args.config}, bf16 weights, batch 1, {args.context} in / {OUT_TOKENS} out, "
        f"best of {args.repeats}, {torch.get_num_threads()} threads; "
        f"CPU flags: {cpu_flag_summary()}"
    )
    print("| KV cache | decode tok/s | vs bf16 cache | KV blocks in the same memory |")
    print("|---|---|---|---|")
    for cache, llm in llms.items():
        blocks = llm.llm_engine.block_manager.num_blocks
        name = "bf16" if cache == "auto" else "fp8_e4m3"
        speed = (OUT_TOKENS - 1) / best[cache]
        print(f"| {name} | {speed:.1f} | {base / best[cache]:.2f}x | {blocks} |")
    same = sum(a == b for a, b in zip(tokens["auto"], tokens["fp8"], strict=True))
    print(f"greedy tokens equal at {same} of {OUT_TOKENS} positions (dummy weights)")
    cfg = llms["auto"].llm_engine.model_config.hf_config
    head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    alone = kernel_alone(args.context, cfg.num_key_value_heads, head, args.repeats)
    if alone:
        print(
            f"decode-attention kernel alone, one layer, {args.context} keys: "
            + ", ".join(f"{k} {v:.0f} us" for k, v in alone.items())
            + f" ({alone['bf16'] / alone['fp8_e4m3']:.2f}x)"
        )


if __name__ == "__main__":
    main()
