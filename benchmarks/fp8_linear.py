"""FP8 linear layers on CPU: which path the loader should give them (`layers/quantization/fp8`).

    python benchmarks/fp8_linear.py [--model llama-100m] [--rows 1,128] [--budget 0.5]

For each linear shape of one decoder layer of the config (qkv, o, gate_up, down), bf16
activations and each row count M (1: a batch-1 decode step; 128: a prefill chunk), prints the
fastest call of:
- dense: the bf16 weight through the engine's CPU path (`cpu_prepack.linear`: the small-M C
  kernel at M <= 2, else oneDNN / F.linear), what a layer dequantized once at load runs;
- fp8-kernel: `FP8Weight.linear` keeping the fp8 bytes (per-tensor scale): the C kernel
  (`native.fp8_gemv`) at M <= 8, else the weight dequantized by it per call then `F.linear`;
- fp8-torch: the same weight dequantized with torch ops per call then `F.linear` (the path
  where the kernel is unavailable);
- scaled_mm: `scaled_linear`, W8A8 through torch's CPU `torch._scaled_mm` (row-wise scales).
The sum over the layer's shapes is the layer's time per step; the winner is the CPU default.
Weights are cycled over >= `--cold-gib` GiB of copies, so they come from memory, as in a model
larger than the caches. torch's routes are timed at M=1 on the smaller layers only (slow).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.linear_bandwidth import _best_seconds, linear_shapes  # noqa: E402
from tokenwise.layers import cpu_prepack  # noqa: E402
from tokenwise.layers.quantization.fp8 import quantize_fp8, scaled_linear  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-100m")
    parser.add_argument("--rows", default="1,8,128")
    parser.add_argument("--budget", type=float, default=0.5, help="seconds per path and shape")
    parser.add_argument(
        "--cold-gib", type=float, default=0.25, help="cycle bf16 weights over this many GiB"
    )
    args = parser.parse_args()
    shapes = {k: v for k, v in linear_shapes(args.model).items() if k != "lm_head"}
    print(f"{args.model}, bf16 activations, {torch.get_num_threads()} threads; ms per call")
    for rows in (int(r) for r in args.rows.split(",")):
        totals: dict[str, float] = {}
        for name, (n, k) in shapes.items():
            copies = max(1, int(args.cold_gib * 2**30 / (n * k * 2)))
            dense = [(torch.randn(n, k) * 0.02).bfloat16() for _ in range(copies)]
            fp8 = [quantize_fp8(d) for d in dense]
            x = torch.randn(rows, k).bfloat16()
            fns: dict[str, Callable[[int], object]] = {
                "dense": lambda i, d=dense, x=x: cpu_prepack.linear(x, d[i], None, None),
                "fp8-kernel": lambda i, w=fp8, x=x: w[i].linear(x, None),
                "fp8-torch": lambda i, w=fp8, x=x: torch.nn.functional.linear(
                    x, (w[i].weight.float() * w[i].scale).bfloat16()
                ),
                "scaled_mm": lambda i, w=fp8, x=x: scaled_linear(x, w[i], None),
            }
            if rows > 1 or n * k > 2**21:  # torch's CPU routes: one rep is enough to rank them
                fns.pop("fp8-torch"), fns.pop("scaled_mm")
            best = _best_seconds(fns, copies, args.budget)
            cells = "  ".join(f"{p} {s * 1e3:8.3f}" for p, s in best.items())
            print(f"M={rows:4d} {name:8s} [{n}x{k}]  {cells}")
            for p, s in best.items():
                totals[p] = totals.get(p, 0.0) + s
        cells = "  ".join(f"{p} {s * 1e3:8.3f}" for p, s in totals.items())
        print(f"M={rows:4d} layer total          {cells}")


if __name__ == "__main__":
    with torch.no_grad():
        main()
