"""Decode-sized linear layers with int8 / int4 weights against the dense kernel, on CPU.

    python benchmarks/quantized_linear.py [--rows 1,2,4,8] [--models llama-100m,qwen3-0.6b]
        [--dtypes bfloat16,float32] [--layers qkv,gate_up] [--fp32-activations float|int8]

For each linear shape of the model configs (qkv, o, gate_up, down, lm_head), each activation
dtype and row count M, prints the fastest call of: the dense path the engine takes for that
weight dtype (`cpu_prepack.linear`: the small-M C kernel, else oneDNN), and the quantized
layers (`QuantizedWeight.linear`: int8 symmetric, int4 symmetric, int4 with offsets, groups of
32), with the weight bytes each reads per second and its speed-up over the dense path measured
in the same run. Weights are cycled over >= `--cold-gib` GiB of copies per path, so they come
from memory as in the decode step of a model larger than the caches; paths take turns in short
bursts (`linear_bandwidth._best_seconds`), so other load falls on all alike. The memory
bandwidth is measured among those bursts (`torch.sum` over the same dense weight copies: on a
shared machine a separate measurement catches other moments' load), and each quantized path's
GB/s is also given as its share of it. `--fp32-activations int8`
runs float32 x through the int8-activation path (TOKENWISE_CPU_QUANT_FP32_ACTIVATIONS).
On an AVX-512 machine, `TOKENWISE_CPU_MARCH=haswell ATEN_CPU_CAPABILITY=avx2
ONEDNN_MAX_CPU_ISA=AVX2` measures the AVX2 paths.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.linear_bandwidth import _best_seconds, linear_shapes  # noqa: E402
from tokenwise.layers import cpu_prepack  # noqa: E402
from tokenwise.layers.quantization.weight_only import quantize  # noqa: E402
from tokenwise.model_config import cpu_flag_summary  # noqa: E402
from tokenwise.native import qgemv as cpu_qgemv  # noqa: E402

FORMATS = {"int8": (8, True), "int4": (4, True), "int4+offsets": (4, False)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--models", default="llama-100m,qwen3-0.6b")
    parser.add_argument("--layers", default="", help="only these layer names (comma-separated)")
    parser.add_argument("--cold-gib", type=float, default=0.5)
    parser.add_argument("--budget", type=float, default=0.25, help="seconds per measurement")
    parser.add_argument("--fp32-activations", choices=("float", "int8"), default=None)
    args = parser.parse_args()
    if args.fp32_activations:
        os.environ[cpu_qgemv.FP32_ACTIVATIONS_ENV] = args.fp32_activations
    torch.manual_seed(0)
    lib = cpu_qgemv.load()
    print(f"CPU flags: {cpu_flag_summary()}; threads: {torch.get_num_threads()}")
    print(f"quantized kernel: {cpu_qgemv.ISA_NAMES.get(lib.tw_qgemv_isa()) if lib else 'none'}")
    fp32_bits = cpu_qgemv.fp32_activation_bits()
    print(f"float32 activations: {'int8 per 32 values' if fp32_bits == 8 else 'float (exact)'}")
    print()
    heads = " | ".join(f"{f} µs (GB/s, % of bandwidth, speed-up)" for f in FORMATS)
    print(f"| model | layer | N x K | x dtype | M | sum GB/s | dense µs (GB/s) | {heads} |")
    print("|---|---|---|---|---|---|---|" + "---|" * len(FORMATS))
    wanted = set(filter(None, args.layers.split(",")))
    rows = [int(r) for r in args.rows.split(",")]
    for model in args.models.split(","):
        for name, (n, k) in linear_shapes(model).items():
            if wanted and name not in wanted:
                continue
            for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
                _measure(
                    f"{model} | {name} | {n} x {k} | {str(dtype)[6:]}", n, k, dtype, rows, args
                )


def _measure(
    label: str, n: int, k: int, dtype: torch.dtype, rows: list[int], args: argparse.Namespace
) -> None:
    dense_bytes = n * k * dtype.itemsize
    copies = max(1, -(-int(args.cold_gib * 2**30) // dense_bytes))
    weights = [(torch.randn(n, k) / k**0.5).to(dtype) for _ in range(copies)]
    quantized = {}
    for fmt, (bits, symmetric) in FORMATS.items():
        first = quantize(weights[0], bits, 32, symmetric)
        count = max(1, -(-int(args.cold_gib * 2**30) // first.nbytes))
        quantized[fmt] = [first] + [
            quantize(weights[i % copies], bits, 32, symmetric) for i in range(1, count)
        ]
    for m in rows:
        x = torch.randn(m, k).to(dtype)
        paths = {
            "sum": lambda i: weights[i % copies].sum(),
            "dense": lambda i, x=x: cpu_prepack.linear(x, weights[i % copies], None, None),
        }
        for fmt, layers in quantized.items():
            paths[fmt] = lambda i, x=x, ls=layers: ls[i % len(ls)].linear(x, None)
        times = _best_seconds(
            paths, max(copies, *(len(v) for v in quantized.values())), args.budget
        )
        dense, bandwidth = times["dense"], dense_bytes / times["sum"]
        cells = [f"{bandwidth / 1e9:.1f}", f"{dense * 1e6:.0f} ({dense_bytes / dense / 1e9:.1f})"]
        for fmt, layers in quantized.items():
            t = times[fmt]
            gbs = layers[0].nbytes / t / 1e9
            share = 100 * gbs * 1e9 / bandwidth
            cells.append(f"{t * 1e6:.0f} ({gbs:.1f}, {share:.0f}%, {dense / t:.2f}x)")
        print(f"| {label} | {m} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
