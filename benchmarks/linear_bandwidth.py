"""Weight bandwidth of decode-sized linear layers: F.linear, oneDNN prepacked, our C kernel.

    python benchmarks/linear_bandwidth.py [--rows 1,2,4,8] [--dtypes float32,bfloat16]
        [--models llama-100m,qwen3-0.6b] [--hot]

Batch-1 decode reads every weight once per step for a handful of rows, so a linear layer's
speed there is its weight bytes / time. For the linear shapes of each model config under
benchmarks/configs (qkv, o, gate_up, down, lm_head) and each row count M, this prints the
median time of each path and that weight bandwidth in GB/s, next to the machine's memory read
bandwidth measured in the same run (`torch.sum` over 24 MiB chunks of a float32 buffer of
`--sum-gib` GiB, far larger than the caches, each chunk in turn, timed like the linear paths)
and the CPU flags, with torch's thread count (`--threads`, default torch's). `--rows` may go
past 8 (e.g. 16,32,64): the kernel takes any row count, and the engine sends it up to
`gemv.max_rows(dtype)` rows, the crossover with the prepacked path measured here.

By default each call reads a different copy of the weight, cycling through copies of at least
`--cold-gib` GiB in all, so weights come from memory as in a decode step of a model larger
than the last-level cache. `--hot` reuses one copy (the weights then sit in cache when small).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenwise.layers import cpu_prepack  # noqa: E402
from tokenwise.model_config import cpu_flag_summary  # noqa: E402
from tokenwise.native import gemv as cpu_gemv  # noqa: E402

CONFIGS = Path(__file__).resolve().parent / "configs"


def linear_shapes(model: str) -> dict[str, tuple[int, int]]:
    """name: (out_features N, in_features K) of one decoder layer's linears and the LM head."""
    cfg = json.loads((CONFIGS / model / "config.json").read_text())
    hidden = cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q = cfg["num_attention_heads"] * head_dim
    kv = cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * head_dim
    inter = cfg["intermediate_size"]
    return {
        "qkv": (q + 2 * kv, hidden),
        "o": (hidden, q),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
        "lm_head": (cfg["vocab_size"], hidden),
    }


def _best_seconds(
    fns: dict[str, Callable[[int], object]], copies: int, budget_s: float
) -> dict[str, float]:
    """Fastest call of each `fn(i)` (i cycling over the weight copies), the paths taking turns
    in short bursts so that load from other processes falls on all of them alike. The minimum,
    not the median: on a shared 2-core machine the median is mostly preemption."""
    for fn in fns.values():
        for i in range(copies):
            fn(i)
    best = dict.fromkeys(fns, float("inf"))
    deadline = time.perf_counter() + budget_s * len(fns)
    rounds = 0
    while rounds < 3 or time.perf_counter() < deadline:
        for name, fn in fns.items():
            for i in range(max(copies, 5)):
                start = time.perf_counter()
                fn(i % copies)
                best[name] = min(best[name], time.perf_counter() - start)
        rounds += 1
    return best


def memory_bandwidth(gib: float, chunk_mib: int = 24) -> float:
    """Bytes/s of `torch.sum` over `chunk_mib` MiB float32 chunks of a `gib` GiB buffer, taken
    in turn (so each comes from memory) and timed like the linear paths (fastest call): the
    same method, so the kernel's share of it compares like with like."""
    chunk = chunk_mib * 2**20 // 4
    chunks = torch.ones(max(1, int(gib * 2**30) // 4 // chunk), chunk)
    seconds = _best_seconds({"sum": lambda i: chunks[i].sum()}, chunks.shape[0], 1.0)["sum"]
    return chunk * 4 / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--models", default="llama-100m,qwen3-0.6b")
    parser.add_argument("--layers", default="", help="only these layer names (comma-separated)")
    parser.add_argument("--hot", action="store_true", help="reuse one weight copy")
    parser.add_argument("--cold-gib", type=float, default=1.0)
    parser.add_argument("--sum-gib", type=float, default=2.0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: as is)")
    parser.add_argument("--budget", type=float, default=0.25, help="seconds per measurement")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    lib = cpu_gemv.load()
    print(f"CPU flags: {cpu_flag_summary()}")
    print(f"threads: {torch.get_num_threads()}; torch {torch.__version__}")
    print(f"our kernel: {cpu_gemv.isa_name(lib) if lib else 'not available'}")
    bandwidth = memory_bandwidth(args.sum_gib)
    print(
        f"memory read bandwidth (torch.sum of 24 MiB chunks of a {args.sum_gib:g} GiB float32 "
        "buffer, in turn, fastest call): "
        f"{bandwidth / 1e9:.1f} GB/s"
    )
    cold = f">= {args.cold_gib:g} GiB of copies, cycled (cold)"
    print(f"weights: {'one copy, reused (hot)' if args.hot else cold}")
    print()
    print(
        "| model | layer | N x K | dtype | M | F.linear µs (GB/s) | prepacked µs (GB/s) "
        "| ours µs (GB/s) | ours % of mem BW | ours vs prepacked |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    wanted = set(filter(None, args.layers.split(",")))
    rows = [int(r) for r in args.rows.split(",")]
    for model in args.models.split(","):
        for name, (n, k) in linear_shapes(model).items():
            if not wanted or name in wanted:
                for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
                    label = f"{model} | {name} | {n} x {k} | {str(dtype)[6:]}"
                    _measure_layer(label, n, k, dtype, rows, lib, bandwidth, args)


def _measure_layer(
    label: str,
    n: int,
    k: int,
    dtype: torch.dtype,
    rows: list[int],
    lib: object,
    bandwidth: float,
    args: argparse.Namespace,
) -> None:
    """One table row per row count for an [n, k] weight of `dtype`."""
    nbytes = n * k * dtype.itemsize
    copies = 1 if args.hot else max(1, -(-int(args.cold_gib * 2**30) // nbytes))
    weights = [(torch.randn(n, k) / k**0.5).to(dtype) for _ in range(copies)]
    packed_dtype = cpu_prepack._packed_dtype(dtype)
    packed = [torch.ops.mkldnn._reorder_linear_weight(w.to(packed_dtype)) for w in weights]
    for m in rows:
        x = torch.randn(m, k).to(dtype)
        paths = {
            "F.linear": lambda i, x=x: F.linear(x, weights[i]),
            "prepacked": lambda i, x=x: cpu_prepack._packed_linear(x, packed[i], None),
        }
        if lib is not None:
            paths["ours"] = lambda i, x=x: cpu_gemv.linear(lib, x, weights[i], None)
        times = _best_seconds(paths, copies, args.budget)
        cells = [f"{t * 1e6:.0f} ({nbytes / t / 1e9:.1f})" for t in times.values()]
        ours = times.get("ours")
        if ours is None:
            cells += ["-", "-", "-"]
        else:
            cells += [f"{nbytes / ours / bandwidth:.0%}", f"{times['prepacked'] / ours:.2f}x"]
        print(f"| {label} | {m} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
