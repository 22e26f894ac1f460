"""What exact GPTQ act-order slices cost a row-parallel rank (o_proj, down_proj) on CPU.

    python benchmarks/act_order_tp.py [--tp 2] [--rows 1] [--dtypes float32,bfloat16]

Rank 0's slice of int4 GPTQ act-order weights (groups of 128, float16 scales and offsets,
random `g_idx` as GPTQ's `desc_act` gives: `g_idx[perm[i]] = i // 128`), held three ways:
- `requantized`: the old fallback, the dense slice rounded again in groups of 128 (not the
  checkpoint's weights; the byte count of an exact group-index-aware kernel, which reads every
  rank's column once, with the scales of 128-column groups);
- `padded`: `act_order_slice` (exact: each group's run padded to whole kernel groups);
- `unpadded`: a slice-sized act-order weight in groups of 128 with an `input_perm`, i.e. the
  layer's gather without padding (what the same rank costs when its columns happen to fill
  whole groups).
Prints each path's fastest call (`linear_bandwidth._best_seconds`: weights cycled over
`--cold-gib` GiB of copies, so they come from memory as in decode), bytes and columns.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.linear_bandwidth import _best_seconds  # noqa: E402
from tokenwise.layers.quantization.act_order_slice import slice_act_order_columns  # noqa: E402
from tokenwise.layers.quantization.prequantized import integer_weight  # noqa: E402
from tokenwise.layers.quantization.weight_only import quantize  # noqa: E402

GROUP = 128
SHAPES = {  # (name, out_features N, in_features K of the whole layer)
    "qwen3-0.6b o_proj": (1024, 2048),
    "qwen3-0.6b down_proj": (1024, 3072),
    "llama-3-8b down_proj": (4096, 14336),
}


def act_order_record(n: int, k: int, seed: int):
    """A random int4 GPTQ act-order record `[n, k]` (asymmetric, groups of 128)."""
    gen = torch.Generator().manual_seed(seed)
    groups = torch.empty(k, dtype=torch.int64)
    groups[torch.randperm(k, generator=gen)] = torch.arange(k) // GROUP
    q = torch.randint(0, 16, (n, k), generator=gen)
    z = torch.randint(0, 16, (n, k // GROUP), generator=gen)
    s = (torch.rand(n, k // GROUP, generator=gen) / 50).half()
    return integer_weight("layer", q, z, s, 4, groups, signed=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--cold-gib", type=float, default=0.25)
    parser.add_argument("--budget-s", type=float, default=2.0)
    args = parser.parse_args()
    print(f"torch threads: {torch.get_num_threads()}, TP={args.tp}, rows={args.rows}")
    for label, (n, k) in SHAPES.items():
        width = k // args.tp
        full = act_order_record(n, k, seed=0)
        padded = slice_act_order_columns(full, 0, width)
        dense = padded.dequantize()
        paths = {
            "requantized": quantize(dense, 4, GROUP, symmetric=False),
            "padded": padded,
            "unpadded": act_order_record(n, width, seed=1),
        }
        copies = max(2, int(args.cold_gib * 2**30 / padded.nbytes))
        held = {name: [w] for name, w in paths.items()}
        for name, w in paths.items():  # distinct copies, so each call reads from memory
            held[name] += [_copy(w) for _ in range(copies - 1)]
        for dtype in args.dtypes.split(","):
            x = torch.randn(args.rows, width).to(getattr(torch, dtype))
            fns = {name: (lambda i, ws=ws, x=x: ws[i].linear(x, None)) for name, ws in held.items()}
            best = _best_seconds(fns, copies, args.budget_s)
            line = ", ".join(
                f"{name} {best[name] * 1e6:.0f} us ({paths[name].nbytes / 2**20:.2f} MiB, "
                f"{paths[name].shape[1]} columns)"
                for name in paths
            )
            print(f"{label} [{n}x{width}] {dtype}: {line}")


def _copy(w):
    from dataclasses import replace

    return replace(
        w,
        qweight=w.qweight.clone(),
        scales=w.scales.clone(),
        offsets=None if w.offsets is None else w.offsets.clone(),
    )


if __name__ == "__main__":
    main()
