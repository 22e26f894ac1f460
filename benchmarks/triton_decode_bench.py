"""Time the Triton paged-decode kernel against PyTorch's batched reference on one GPU.

    python benchmarks/triton_decode_bench.py

Qwen3-0.6B's attention shape (16 query heads, 8 KV heads, head 128, blocks of 16, bf16) at the
batch sizes and context lengths a serving step sees. Prints microseconds per call and the
achieved K/V read bandwidth (the kernel's bound: every cached token's K and V is read once).
"""

from __future__ import annotations

import importlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenwise.attention.backends.torch_backend import paged_decode_reference  # noqa: E402


def main() -> None:
    from triton.testing import do_bench

    kernel = importlib.import_module("tokenwise.attention.backends.triton_paged_decode")
    heads, kv_heads, head, block, dtype = 16, 8, 128, 16, torch.bfloat16
    print(f"{torch.cuda.get_device_name()}, heads {heads}/{kv_heads}, head {head}, {dtype}")
    print("| seqs | context | kernel | us/call | K/V GB/s |")
    print("|---|---|---|---|---|")
    for n, ctx in ((16, 512), (64, 1024), (256, 1024), (256, 2048)):
        blocks_per_seq = -(-ctx // block)
        num_blocks = n * blocks_per_seq + 1
        k = torch.randn(num_blocks, block, kv_heads, head, device="cuda", dtype=dtype)
        v = torch.randn_like(k)
        tables = torch.randperm(num_blocks - 1, device="cuda")[: n * blocks_per_seq]
        tables = tables.view(n, blocks_per_seq).int()
        lens = torch.full((n,), ctx, device="cuda", dtype=torch.int32)
        q = torch.randn(n, heads, head, device="cuda", dtype=dtype)
        ref = paged_decode_reference(q, k, v, tables, lens, head**-0.5)
        kv_bytes = 2 * n * ctx * kv_heads * head * k.element_size()
        args = (q, k, v, tables, lens, head**-0.5)
        err = (kernel.paged_decode(*args).float() - ref.float()).abs().max().item()
        for name, fn in ((f"triton (max err {err:.3f})", kernel.paged_decode),
                         ("torch reference", paged_decode_reference)):  # fmt: skip
            ms = do_bench(lambda fn=fn, args=args: fn(*args))
            print(f"| {n} | {ctx} | {name} | {ms * 1e3:.0f} | {kv_bytes / ms / 1e6:.0f} |")


if __name__ == "__main__":
    main()
