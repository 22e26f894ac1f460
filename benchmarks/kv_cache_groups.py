"""KV blocks one long request holds, and requests that fit a fixed pool: one kind of block
(every layer keeps every token) against KV-cache groups (sliding-window groups free what left
their window), for Gemma-3-shaped models.

    python benchmarks/kv_cache_groups.py [--pool-gib 8] [--contexts 4096 8192 16384]

For each shape and context length, one request is prefilled in chunks of
`--max-num-batched-tokens` and then decodes `--decode` tokens, driven through the real
`BlockManager` (the scheduler's calls, no model): "before" with one full-attention group whose
block costs a page of every layer (how tokenwise laid out the cache before groups), "after"
with the layout the runner builds from the layers' specs (`tokenwise.kv_cache.layout`). It
prints, per row, the blocks and bytes the request holds while it decodes (and, after, its
peak: a prefill chunk's blocks stay until the window passes them), the most blocks any sliding
group held during decode (the bound is window/block_size + 1), and how many decoding requests
of that length fit a pool of `--pool-gib` GiB. Pure bookkeeping: no CPU flags matter here.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from tokenwise.engine.block_manager import BlockManager
from tokenwise.kv_cache.layout import KVCacheLayout, make_layout
from tokenwise.kv_cache.specs import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec


@dataclass(frozen=True)
class Shape:
    name: str
    num_layers: int
    global_every: int  # every `global_every`-th layer is global (Gemma 3: 6)
    window: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2  # bf16


SHAPES = (
    Shape("gemma-3-1b", 26, 6, 512, 1, 256),
    Shape("gemma-3-4b", 34, 6, 1024, 4, 256),
)


def layer_specs(shape: Shape, block_size: int) -> dict[str, KVCacheSpec]:
    page = 2 * block_size * shape.num_kv_heads * shape.head_dim * shape.dtype_bytes
    storage = ((2, 1, block_size, shape.num_kv_heads, shape.head_dim), "bf16")
    specs: dict[str, KVCacheSpec] = {}
    for i in range(shape.num_layers):
        if (i + 1) % shape.global_every == 0:
            specs[f"layers.{i}"] = FullAttentionSpec(block_size, page, storage)
        else:
            specs[f"layers.{i}"] = SlidingWindowSpec(block_size, page, storage, shape.window)
    return specs


def one_kind(specs: dict[str, KVCacheSpec], block_size: int) -> KVCacheLayout:
    """Before groups: every layer one full-attention table, one page of each per block."""
    page = next(iter(specs.values())).page_size_bytes
    full = FullAttentionSpec(block_size, page, ("all",))
    return make_layout({name: full for name in specs})


def run(layout: KVCacheLayout, context: int, chunk: int, decode: int, block_size: int) -> dict:
    """Peak blocks of one request through prefill and decode, and the sliding groups' peak
    during decode."""
    bm = BlockManager(1 << 20, block_size, enable_caching=False, specs=layout.specs)
    tokens = list(range(context))
    computed, peak, sliding_peak = 0, 0, 0
    sliding = [m for m in bm.managers if isinstance(m.spec, SlidingWindowSpec)]
    while computed < context + decode:
        n = min(chunk, context - computed) if computed < context else 1
        if computed >= context:
            tokens.append(7)
        if bm.allocate_slots("r", tokens, computed, n) is None:
            raise RuntimeError("pool too small")
        computed += n
        peak = max(peak, bm.num_held_blocks("r"))
        if computed > context:
            sliding_peak = max([sliding_peak] + [m.num_held("r") for m in sliding])
    return {
        "peak_blocks": peak,
        "decode_blocks": bm.num_held_blocks("r"),
        "sliding_peak": sliding_peak,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pool-gib", type=float, default=8.0)
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--decode", type=int, default=256)
    parser.add_argument("--json", action="store_true", help="one JSON line per row")
    args = parser.parse_args()
    bs, pool = args.block_size, int(args.pool_gib * 2**30)
    header = (
        f"{'shape':<11} {'context':>7} | {'before: blocks':>14} {'MiB':>7} {'fit':>5} | "
        f"{'after: blocks':>13} {'peak':>5} {'MiB':>7} {'fit':>5} | "
        f"{'sliding peak':>12} {'bound':>5} | {'fit x':>6}"
    )
    if not args.json:
        print(
            f"pool {args.pool_gib:g} GiB, block {bs}, chunk {args.max_num_batched_tokens}, "
            f"{args.decode} decode steps"
        )
        print(header)
    for shape in SHAPES:
        specs = layer_specs(shape, bs)
        after_layout = make_layout(specs)
        before_layout = one_kind(specs, bs)
        for context in args.contexts:
            row: dict = {"shape": shape.name, "context": context, "window": shape.window}
            for label, layout in (("before", before_layout), ("after", after_layout)):
                got = run(layout, context, args.max_num_batched_tokens, args.decode, bs)
                held = got["decode_blocks"] * layout.bytes_per_block
                row[label] = {
                    "groups": len(layout.groups),
                    "peak_blocks": got["peak_blocks"],
                    "decode_blocks": got["decode_blocks"],
                    "bytes": held,
                    "requests_fit": pool // held,
                    "sliding_peak": got["sliding_peak"],
                }
            bound = shape.window // bs + 1
            b, a = row["before"], row["after"]
            if args.json:
                print(json.dumps(row))
                continue
            print(
                f"{shape.name:<11} {context:>7} | {b['decode_blocks']:>14} "
                f"{b['bytes'] / 2**20:>7.1f} {b['requests_fit']:>5} | {a['decode_blocks']:>13} "
                f"{a['peak_blocks']:>5} {a['bytes'] / 2**20:>7.1f} {a['requests_fit']:>5} | "
                f"{a['sliding_peak']:>12} {bound:>5} | "
                f"{a['requests_fit'] / max(1, b['requests_fit']):>5.1f}x"
            )
        if not args.json:
            print(f"  {shape.name}: {after_layout.describe()}")


if __name__ == "__main__":
    main()
