"""One-stream decode over a long context with a bf16 KV cache and an fp8 one, in one run.

    python benchmarks/kv_cache_fp8.py [--config llama-100m] [--context 3072] [--threads N]

Why: at batch 1 every decode step reads the whole KV cache, so on a CPU an fp8 cache (one byte
per element instead of two) can pay where attention is a visible part of the step, i.e. with
a long context. Two engines, bf16 weights (dummy), the same prompt of `--context` tokens and
64 greedy tokens, their decode steps taking turns one by one so machine noise hits them alike;
printed: the median step and tok/s of each, the ratio, whether the greedy tokens agree, the KV
capacity each gets from the same memory, the decode-attention kernel alone on one layer's
cache at that length and longer ones (calls alternating, fastest kept), and the CPU flags.
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
from tokenwise.attention.backends.kv_quant import quantize  # noqa: E402
from tokenwise.model_config import cpu_flag_summary  # noqa: E402
from tokenwise.native import paged_decode as cpu_paged_decode  # noqa: E402

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
CACHES = ("auto", "fp8")  # auto = the weights' bf16
OUT_TOKENS = 64


def kernel_alone(context: int, heads: int, head_size: int, rounds: int) -> dict[str, float]:
    """Microseconds per call of the C decode kernel, one sequence of `context` keys: the two
    caches take turns call by call (noise hits both alike), the fastest call of each kept."""
    lib = cpu_paged_decode.load()
    if lib is None:
        return {}
    block = 16
    blocks = -(-context // block)
    shape = (blocks, block, heads, head_size)
    q = torch.randn(1, heads, head_size)
    out = torch.empty_like(q)
    table = torch.randperm(blocks, dtype=torch.int32)[None]
    lens, first = torch.tensor([context], dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    caches = {
        name: (quantize(torch.randn(shape), dtype, 1.0), quantize(torch.randn(shape), dtype, 1.0))
        for name, dtype in [("bf16", torch.bfloat16), ("fp8_e4m3", torch.float8_e4m3fn)]
    }
    best = dict.fromkeys(caches, float("inf"))
    for _ in range(rounds):
        for name, (k, v) in caches.items():
            start = time.perf_counter()
            cpu_paged_decode.paged_decode(lib, q, k, v, table, lens, first, None, 0.125, out)
            best[name] = min(best[name], time.perf_counter() - start)
    return {name: t * 1e6 for name, t in best.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="llama-100m", help="a folder of benchmarks/configs")
    parser.add_argument("--context", type=int, default=3072, help="prompt tokens")
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
    params = SamplingParams(temperature=0, max_tokens=OUT_TOKENS, ignore_eos=True)
    for llm in llms.values():  # warm-up: kernels built, caches touched
        llm.generate([prompt[:64]], params, use_tqdm=False)
    engines = {cache: llm.llm_engine for cache, llm in llms.items()}
    for engine in engines.values():
        engine.add_request("bench", prompt, params)
        engine.step()  # the prefill (and first token)
    # Decode steps, the two engines taking turns step by step so that machine noise (other
    # processes on the cores) hits them alike; the median step of each.
    steps: dict[str, list[float]] = {cache: [] for cache in engines}
    tokens: dict[str, list[int]] = {cache: [] for cache in engines}
    while any(e.has_unfinished_requests() for e in engines.values()):
        for cache, engine in engines.items():
            if not engine.has_unfinished_requests():
                continue
            start = time.perf_counter()
            outs = engine.step()
            steps[cache].append(time.perf_counter() - start)
            for out in outs:
                tokens[cache] = list(out.outputs[0].token_ids)
    median = {cache: sorted(t)[len(t) // 2] for cache, t in steps.items()}
    print(
        f"{args.config}, bf16 weights, batch 1, {args.context}-token context, "
        f"{OUT_TOKENS - 1} decode steps each, {torch.get_num_threads()} threads; "
        f"CPU flags: {cpu_flag_summary()}"
    )
    print("| KV cache | median decode step | tok/s | vs bf16 cache | KV blocks, same memory |")
    print("|---|---|---|---|---|")
    for cache, engine in engines.items():
        name = "bf16" if cache == "auto" else "fp8_e4m3"
        blocks = engine.block_manager.num_blocks
        ratio = median["auto"] / median[cache]
        print(
            f"| {name} | {median[cache] * 1e3:.1f} ms | {1 / median[cache]:.1f} | "
            f"{ratio:.2f}x | {blocks} |"
        )
    print(f"greedy tokens (dummy weights) equal: {tokens['auto'] == tokens['fp8']}")
    cfg = llms["auto"].llm_engine.model_config.hf_config
    head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    for context in sorted({args.context, 16384, 65536}):
        alone = kernel_alone(context, cfg.num_key_value_heads, head, 40)
        if alone:
            print(
                f"decode-attention kernel alone, one layer, {context} keys: "
                + ", ".join(f"{k} {v:.0f} us" for k, v in alone.items())
                + f" (fp8 {alone['bf16'] / alone['fp8_e4m3']:.2f}x faster)"
            )


if __name__ == "__main__":
    main()
