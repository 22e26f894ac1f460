"""Per-step CPU time of input preparation: the persistent `InputBatch` vs per-step lists.

    python benchmarks/input_prep_bench.py [--steps 200]

For 64 and 256 running requests (contexts of 100..2000 tokens, blocks of 16), each step decodes
one token per request, plus a mixed step where a quarter of the requests prefill a 64-token
chunk. "before" is the preparation the runner did until the input batch replaced it (kept here
as the baseline): Python lists per step, `CommonMetadataBuilder.add_sequence/build`, fresh
tensors. "after" is `InputBatch.prepare` + `CommonMetadataBuilder.build_from_buffers`, with the
batch's rows updated as a real engine would (one new token and, every 16 tokens, one new block
per request). Both produce the model inputs and attention metadata of the step; the figure is
the median wall time per step on this machine's CPU, both measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenwise.attention.metadata import CommonMetadataBuilder  # noqa: E402
from tokenwise.engine.request import Request  # noqa: E402
from tokenwise.engine.step_outputs import ScheduledRequest  # noqa: E402
from tokenwise.runner.input_batch import InputBatch  # noqa: E402
from tokenwise.sampling.params import SamplingParams  # noqa: E402

BLOCK = 16
MAX_MODEL_LEN = 4096


def make_requests(n: int, seed: int) -> list[Request]:
    gen = torch.Generator().manual_seed(seed)
    reqs, next_block = [], 0
    for i in range(n):
        length = int(torch.randint(100, 2000, (1,), generator=gen))
        tokens = torch.randint(0, 32000, (length,), generator=gen).tolist()
        req = Request(f"r{i}", tokens, SamplingParams(max_tokens=1000))
        blocks = -(-(length + 1) // BLOCK)
        req.block_table = list(range(next_block, next_block + blocks))
        next_block += blocks + 64  # room to grow
        req.num_computed_tokens = length - 1
        reqs.append(req)
    return reqs


def schedule(reqs: list[Request], mixed: bool) -> list[ScheduledRequest]:
    items = []
    for i, req in enumerate(reqs):
        new = min(64, req.num_tokens - 1) if mixed and i % 4 == 0 else 1
        req.num_computed_tokens = req.num_tokens - new
        items.append(ScheduledRequest(req, new))
    return sorted(items, key=lambda s: s.num_new_tokens == 1)


def before(items: list[ScheduledRequest], builder: CommonMetadataBuilder) -> object:
    """The per-step list-based preparation the runner used before the input batch."""
    input_ids, positions, seq_lens, query_lens, logits_indices = [], [], [], [], []
    builder.prepare()
    for i, item in enumerate(items):
        req, n = item.request, item.num_new_tokens
        start = req.num_computed_tokens
        input_ids.extend(req.all_token_ids[start : start + n])
        positions.extend(range(start, start + n))
        seq_lens.append(start + n)
        query_lens.append(n)
        builder.add_sequence(i, start, n, req.block_table)
        logits_indices.append(len(input_ids) - 1)
    md = builder.build(seq_lens, query_lens)
    ids = torch.tensor(input_ids, dtype=torch.int64)
    pos = torch.tensor(positions, dtype=torch.int64)
    rows = torch.tensor(logits_indices, dtype=torch.int64)
    return md, ids, pos, rows


def after(items: list[ScheduledRequest], batch: InputBatch, builder: CommonMetadataBuilder):
    step = batch.prepare(items)
    md = builder.build_from_buffers(
        step.slot_mapping,
        step.seq_lens,
        step.query_start_loc,
        step.block_tables,
        step.query_lens_np,
        step.context_lens_np,
    )
    rows = torch.tensor(step.logits_indices, dtype=torch.int64)
    return md, step.input_ids, step.positions, rows


def advance(reqs: list[Request]) -> None:
    """What a decode step does to every request: one more token, a new block when full."""
    for req in reqs:
        req.append_output_token(7)
        if req.num_tokens > len(req.block_table) * BLOCK:
            req.block_table.append(req.block_table[-1] + 1)


def measure(n: int, mixed: bool, steps: int) -> tuple[float, float]:
    reqs = make_requests(n, seed=n)
    batch = InputBatch(n, n * 64 + n, MAX_MODEL_LEN, BLOCK, torch.device("cpu"))
    b_builder, a_builder = CommonMetadataBuilder(BLOCK), CommonMetadataBuilder(BLOCK)
    times: dict[str, list[float]] = {"before": [], "after": []}
    for _ in range(steps):
        items = schedule(reqs, mixed)
        for name in ("before", "after") if _ % 2 else ("after", "before"):
            start = time.perf_counter()
            before(items, b_builder) if name == "before" else after(items, batch, a_builder)
            times[name].append(time.perf_counter() - start)
        advance(reqs)
    return statistics.median(times["before"]), statistics.median(times["after"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args()
    torch.set_num_threads(1)
    flags = [f for f in ("avx2", "avx512f", "avx512_bf16") if f in open("/proc/cpuinfo").read()]
    print(f"CPU flags: {' '.join(flags)}; median of {args.steps} steps each")
    print("| running requests | step | before (ms) | after (ms) | before / after |")
    print("|---|---|---|---|---|")
    for n in (64, 256):
        for mixed in (False, True):
            b, a = measure(n, mixed, args.steps)
            kind = "decode + 1/4 prefilling 64" if mixed else "decode"
            print(f"| {n} | {kind} | {b * 1e3:.3f} | {a * 1e3:.3f} | {b / a:.1f}x |")


if __name__ == "__main__":
    main()
