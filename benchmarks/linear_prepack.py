"""`F.linear` against oneDNN's linear over a prepacked weight (`tokenwise.layers.cpu_prepack`).

    python benchmarks/linear_prepack.py [--dtype float32] [--rows 1,16,48,256,1024]

For the llama-100m layer shapes (qkv, o, gate_up, down, lm_head) and each row count, GFLOP/s
of both paths in one run (median of repeated calls), next to a 2048^3 matmul: decode steps
have one row per running sequence, prefill chunks hundreds. The CPU flags are printed first.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tokenwise.benchmarks.roofline import measure_matmul_flops
from tokenwise.model_config import cpu_flag_summary

SHAPES = {  # name: (out_features, in_features)
    "qkv": (2304, 768),
    "o": (768, 768),
    "gate_up": (4096, 768),
    "down": (768, 2048),
    "lm_head": (32000, 768),
}


def _seconds(fn: Callable[[], object], budget_s: float = 0.3) -> float:
    fn()
    times: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(times) < 5 or time.perf_counter() < deadline:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rows", default="1,16,48,256,1024")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"CPU flags: {cpu_flag_summary()}; {torch.get_num_threads()} threads")
    print(f"{args.dtype} 2048^3 matmul: {measure_matmul_flops(dtype=args.dtype) / 1e9:.0f} GFLOP/s")
    print("| rows | layer | F.linear GFLOP/s | prepacked GFLOP/s | ratio |")
    print("|---|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        for name, (n, k) in SHAPES.items():
            weight = torch.randn(n, k).to(dtype)
            x = torch.randn(rows, k).to(dtype)
            packed = torch.ops.mkldnn._reorder_linear_weight(weight)
            plain = _seconds(lambda x=x, w=weight: F.linear(x, w))
            fast = _seconds(
                lambda x=x, p=packed: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
            )
            flops = 2.0 * rows * n * k
            print(
                f"| {rows} | {name} | {flops / plain / 1e9:.0f} | {flops / fast / 1e9:.0f} "
                f"| {plain / fast:.2f}x |"
            )


if __name__ == "__main__":
    main()
