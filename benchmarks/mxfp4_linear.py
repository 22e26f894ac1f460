"""gpt-oss's MXFP4 expert projections at decode sizes against our int4 kernel, on CPU.

    python benchmarks/mxfp4_linear.py [--rows 1,4,8] [--shapes gate_up,down] [--cold-gib 0.5]
        [--avx2]

For one expert of gpt-oss-20b/120b (hidden 2880, expert width 2880: gate_up is 5760 x 2880,
down 2880 x 2880), prints the fastest call of: the MXFP4 kernel on the published bytes
(`mxfp4_gemv`: 4.25 bits a weight, 32-value groups with a power-of-two scale), the
symmetric int4 kernel on the same shape (`QuantizedWeight.linear`, groups of 32 with an fp16
scale: 4.5 bits), and the dense float32 path, with the bytes each reads per second. x is float32
(the MXFP4 kernel's input; the int4 kernel is also timed on bfloat16 x, its integer path).
Weights are cycled over >= `--cold-gib` GiB of copies, so they come from memory as one expert
of a large model does; the paths take turns in short bursts (`linear_bandwidth._best_seconds`).
`--avx2` times the MXFP4 kernel built without AVX-512 (the path AVX2-only CPUs get).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.linear_bandwidth import _best_seconds  # noqa: E402
from tokenwise.layers import cpu_prepack  # noqa: E402
from tokenwise.layers.quantization import mxfp4  # noqa: E402
from tokenwise.layers.quantization.weight_only import quantize  # noqa: E402
from tokenwise.model_config import cpu_flag_summary  # noqa: E402
from tokenwise.native import build, mxfp4_gemv, qgemv  # noqa: E402

SHAPES = {"gate_up": (5760, 2880), "down": (2880, 2880)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4,8")
    parser.add_argument("--shapes", default="gate_up,down")
    parser.add_argument("--cold-gib", type=float, default=0.5)
    parser.add_argument("--budget", type=float, default=0.25, help="seconds per measurement")
    parser.add_argument("--avx2", action="store_true", help="the MXFP4 kernel's AVX2 build")
    args = parser.parse_args()
    torch.manual_seed(0)
    mx_lib, q_lib = mxfp4_gemv.load(), qgemv.load()
    if args.avx2:
        flags = [*build.OPENMP_FLAGS, "-mno-avx512f"]
        path = build.build(build.find_compiler(), mxfp4_gemv.KERNEL.source, "mxfp4_avx2", flags)
        mx_lib = mxfp4_gemv.open_library(path)
    args.lib = mx_lib
    print(f"CPU flags: {cpu_flag_summary()}; threads: {torch.get_num_threads()}")
    mx_isa = mxfp4_gemv.ISA_NAMES.get(mx_lib.tw_mxfp4_isa()) if mx_lib else "none"
    q_isa = qgemv.ISA_NAMES.get(q_lib.tw_qgemv_isa()) if q_lib else "none"
    print(f"MXFP4 kernel: {mx_isa}; int4 kernel: {q_isa}")
    print()
    print(
        "| layer | N x K | M | mxfp4 µs (GB/s) | int4 f32-x µs (GB/s) | int4 bf16-x µs (GB/s) "
        "| dense f32 µs (GB/s) | mxfp4 / int4 f32-x |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        _measure(name, n, k, [int(r) for r in args.rows.split(",")], args)


def _copies(nbytes: int, cold_gib: float) -> int:
    return max(1, -(-int(cold_gib * 2**30) // nbytes))


def _measure(name: str, n: int, k: int, rows: list[int], args: argparse.Namespace) -> None:
    weight = torch.randn(n, k) / k**0.5
    blocks, scales = mxfp4.quantize(weight)
    mx_bytes = blocks.numel() + scales.numel()
    mx = [(blocks.clone(), scales.clone()) for _ in range(_copies(mx_bytes, args.cold_gib))]
    q4 = quantize(weight, 4, 32, True)
    q4s = [q4] + [
        quantize(weight, 4, 32, True) for _ in range(_copies(q4.nbytes, args.cold_gib) - 1)
    ]
    dense = [weight.clone() for _ in range(_copies(n * k * 4, args.cold_gib))]
    for m in rows:
        x = torch.randn(m, k)
        xb = x.bfloat16()
        paths = {
            "mxfp4": (
                lambda i, x=x: mxfp4_gemv.mxfp4_gemv(args.lib, x, *mx[i % len(mx)], None),
                mx_bytes,
                len(mx),
            ),
            "int4": (lambda i, x=x: q4s[i % len(q4s)].linear(x, None), q4.nbytes, len(q4s)),
            "int4-bf16": (lambda i, xb=xb: q4s[i % len(q4s)].linear(xb, None), q4.nbytes, len(q4s)),
            "dense": (
                lambda i, x=x: cpu_prepack.linear(x, dense[i % len(dense)], None, None),
                n * k * 4,
                len(dense),
            ),
        }
        copies = max(c for _, _, c in paths.values())
        best = _best_seconds({p: fn for p, (fn, _, _) in paths.items()}, copies, args.budget)
        cells = [f"{best[p] * 1e6:.0f} ({b / best[p] / 1e9:.1f})" for p, (_, b, _) in paths.items()]
        ratio = best["mxfp4"] / best["int4"]
        print(f"| {name} | {n} x {k} | {m} | {' | '.join(cells)} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
