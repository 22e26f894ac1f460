"""Where tokenwise's CPU time goes, and how close decode attention is to the memory bandwidth.

    python benchmarks/cpu_profile.py [--num-prompts 48] [--output-len 64]

1. The compare_hf workload shape (llama-100m, fp32, dummy weights, prompts uniform in 32..384,
   greedy, EOS ignored) under `torch.profiler`: the ops with the most self CPU time and their
   share. `aten::mm` is the linear layers; `tokenwise::unified_attention` (plus the SDPA ops
   under it) is attention.
2. The C decode kernel (`cpu_paged_decode.paged_decode`) over 48 sequences of 240 cached tokens
   (12 heads of 64, fp32 and bf16 caches), as GB/s of K/V read, next to a plain `sum` over the
   same bytes: decode attention is memory-bound, so the second figure is its ceiling here.
The CPU flags are printed with the figures.
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
from tokenwise.native import paged_decode as cpu_paged_decode  # noqa: E402

MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "llama-100m")


def profile_workload(num_prompts: int, output_len: int) -> None:
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(32, 385, (num_prompts,), generator=gen).tolist()
    prompts = [torch.randint(3, 32000, (n,), generator=gen).tolist() for n in lengths]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm = LLM(MODEL, load_format="dummy", dtype="float32", skip_tokenizer_init=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    from torch.profiler import ProfilerActivity, profile

    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    print(f"workload: {num_prompts} prompts, {output_len} new tokens, {elapsed:.1f} s profiled")
    print("| op | self CPU share |")
    print("|---|---|")
    for event in events[:14]:
        print(f"| {event.key} | {100 * event.self_cpu_time_total / total:.1f}% |")


def decode_kernel_bandwidth() -> None:
    lib = cpu_paged_decode.load()
    if lib is None:
        print("no C compiler: the decode kernel cannot be built here")
        return
    nseq, ctx, heads, head, block = 48, 240, 12, 64, 16
    per_seq = -(-ctx // block)
    num_blocks = nseq * per_seq
    tables = torch.randperm(num_blocks, dtype=torch.int32).view(nseq, per_seq).contiguous()
    lens = torch.full((nseq,), ctx, dtype=torch.int32)
    first = torch.zeros(nseq, dtype=torch.int32)
    q, out = torch.randn(nseq, heads, head), torch.empty(nseq, heads, head)
    print("| cache | kernel GB/s | plain read GB/s |")
    print("|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        k = torch.randn(num_blocks + 1, block, heads, head).to(dtype)
        v = torch.randn(num_blocks + 1, block, heads, head).to(dtype)
        nbytes = 2 * nseq * ctx * heads * head * k.element_size()

        def kernel(k=k, v=v) -> None:
            cpu_paged_decode.paged_decode(lib, q, k, v, tables, lens, first, None, head**-0.5, out)

        def read(k=k, v=v) -> None:
            k.sum()
            v.sum()

        rates = []
        for fn in (kernel, read):
            for _ in range(3):
                fn()
            start = time.perf_counter()
            for _ in range(50):
                fn()
            rates.append(nbytes * 50 / (time.perf_counter() - start) / 1e9)
        print(f"| {str(dtype).replace('torch.', '')} | {rates[0]:.1f} | {rates[1]:.1f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--output-len", type=int, default=64)
    args = p.parse_args()
    torch.set_num_threads(2)
    print(f"CPU flags: {cpu_flag_summary()}; {torch.get_num_threads()} threads")
    profile_workload(args.num_prompts, args.output_len)
    decode_kernel_bandwidth()


if __name__ == "__main__":
    main()
