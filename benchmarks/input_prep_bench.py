"""Per-step CPU time of input preparation: a baseline revision vs the working tree.

    python benchmarks/input_prep_bench.py [--baseline-rev 9e099c2] [--steps 200] [--rounds 2]

For 1, 64 and 256 running requests (contexts of 100..2000 tokens, blocks of 16), each step
decodes one token per request, plus a mixed step where a quarter of the requests prefill a
64-token chunk. The measured work is what each revision's model runner does per step before the
forward pass: `InputBatch.prepare`, then the attention metadata the way that revision's runner
builds it (`CommonMetadataBuilder.build_from_buffers` before the metadata refactor,
`prepare()` + `build(...)` after), with the batch's rows updated as a real engine would (one new
token and, every 16 tokens, one new block per request).

"before" runs in a subprocess against a temporary `git worktree` of `--baseline-rev` (its module
paths differ: `tokenwise.engine.input_batch` there, `tokenwise.runner.input_batch` now; the
measurement picks by the tree's files), "after" in a subprocess on the working tree; the rounds alternate and
each figure is the smallest of the rounds' medians (the machine is shared, so the minimum is the
least disturbed). Both on this machine's CPU, in one run.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK = 16
MAX_MODEL_LEN = 4096
SIZES = (1, 64, 256)


# ---- the measurement (runs in a subprocess, against one revision's tokenwise) ----------------


def _imports() -> tuple[Any, Any, Any, Any, Any]:
    """This revision's classes, wherever it keeps them."""
    import tokenwise
    from tokenwise.attention.metadata import CommonMetadataBuilder
    from tokenwise.engine.request import Request
    from tokenwise.engine.step_outputs import ScheduledRequest
    from tokenwise.sampling.params import SamplingParams

    # Decided by the files of the tree on PYTHONPATH: a plain `try: import` could be answered
    # by an editable install's finder, from another checkout.
    root = os.path.dirname(tokenwise.__file__)
    if os.path.exists(os.path.join(root, "runner", "input_batch.py")):
        module = importlib.import_module("tokenwise.runner.input_batch")
    else:  # before the runner/ folder
        module = importlib.import_module("tokenwise.engine.input_batch")
    for cls in (CommonMetadataBuilder, Request, module.InputBatch):
        path = sys.modules[cls.__module__].__file__ or ""
        if not path.startswith(root):
            raise RuntimeError(f"{cls.__name__} came from {path}, not from the tree at {root}")
    return CommonMetadataBuilder, Request, ScheduledRequest, SamplingParams, module.InputBatch


def _metadata_fn(builder: Any) -> Any:
    """How this revision's runner turns a step into metadata (one spec, no sliding window)."""
    if hasattr(builder, "build_from_buffers"):

        def old(step: Any) -> Any:
            return builder.build_from_buffers(
                step.slot_mapping,
                step.seq_lens,
                step.query_start_loc,
                step.block_tables,
                step.query_lens_np,
                step.context_lens_np,
                None,
            )

        return old

    def new(step: Any) -> Any:
        builder.prepare()
        return builder.build(
            step.context_lens_np + step.query_lens_np,
            step.query_lens_np,
            slot_mapping=step.slot_mapping,
            seq_lens_tensor=step.seq_lens,
            block_tables=step.block_tables,
            block_table_first_block=None,
        )

    return new


def _runner_states(reqs: list[Any]) -> Any:
    """This revision's runner-owned request states for `reqs` (None before they existed)."""
    import tokenwise

    root = os.path.dirname(tokenwise.__file__)
    if not os.path.exists(os.path.join(root, "runner", "request_states.py")):
        return None
    from tokenwise.engine.step_outputs import NewRequestData
    from tokenwise.runner.request_states import CachedRequestState, RequestStates

    states = RequestStates()
    for req in reqs:
        states.by_id[req.request_id] = CachedRequestState.create(NewRequestData.of(req))
    return states


def _measure(n: int, mixed: bool, steps: int) -> float:
    import torch

    builder_cls, request_cls, scheduled_cls, params_cls, batch_cls = _imports()
    gen = torch.Generator().manual_seed(n)
    # Revisions up to 9e099c2 kept each table on the request; later ones hand the runner the
    # blocks appended since it last saw the request (`ScheduledRequest.new_block_ids`).
    deltas = "new_block_ids" in getattr(scheduled_cls, "__dataclass_fields__", {})
    reqs, tables, seen, next_block = [], [], [], 0
    for i in range(n):
        length = int(torch.randint(100, 2000, (1,), generator=gen))
        tokens = torch.randint(0, 32000, (length,), generator=gen).tolist()
        req = request_cls(f"r{i}", tokens, params_cls(max_tokens=1000))
        blocks = -(-(length + 1) // BLOCK)
        tables.append(list(range(next_block, next_block + blocks)))
        seen.append(0)
        if not deltas:
            req.block_table = tables[-1]
        next_block += blocks + 64  # room to grow
        reqs.append(req)
    batch = batch_cls(n, n * 64 + n, MAX_MODEL_LEN, BLOCK, torch.device("cpu"))
    metadata = _metadata_fn(builder_cls(BLOCK))
    # Revisions whose runner keeps its own request state: the states are made once (from each
    # request's first step) and looked up each step, which is timed with `prepare`.
    runner_states = _runner_states(reqs)
    times = []
    for _ in range(steps):
        items = []
        for i, req in enumerate(reqs):
            new = min(64, req.num_tokens - 1) if mixed and i % 4 == 0 else 1
            req.num_computed_tokens = req.num_tokens - new
            if deltas:
                table = tables[i]
                items.append(scheduled_cls(req, new, 0, (table[seen[i] :],), (len(table),)))
                seen[i] = len(table)
            else:
                items.append(scheduled_cls(req, new))
        items.sort(key=lambda s: s.num_new_tokens == 1)
        start = time.perf_counter()
        if runner_states is None:
            step = batch.prepare(items)
        else:
            step = batch.prepare(items, runner_states.by_id)
        metadata(step)
        torch.tensor(step.logits_indices, dtype=torch.int64)
        times.append(time.perf_counter() - start)
        for req, table in zip(reqs, tables, strict=True):  # what a decode step does to each
            req.append_output_token(7)
            if runner_states is not None:
                runner_states.by_id[req.request_id].append([7])
            if req.num_tokens > len(table) * BLOCK:
                table.append(table[-1] + 1)
    return statistics.median(times)


def measure_main(steps: int) -> None:
    import torch

    torch.set_num_threads(1)
    out = {f"{n}/{mixed}": _measure(n, mixed, steps) for n in SIZES for mixed in (False, True)}
    print(json.dumps(out))


# ---- the driver ---------------------------------------------------------------------------


def _run(tree: str, steps: int) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=tree)
    cmd = [sys.executable, os.path.abspath(__file__), "--measure", "--steps", str(steps)]
    done = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"measurement in {tree} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--baseline-rev", default="9e099c2")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.measure:
        measure_main(args.steps)
        return
    cpuinfo = open("/proc/cpuinfo").read()
    flags = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in cpuinfo.split()]
    rev = subprocess.run(
        ["git", "-C", REPO, "rev-parse", "--short", args.baseline_rev],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    before: dict[str, list[float]] = {}
    after: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="input_prep_bench_") as tmp:
        tree = os.path.join(tmp, "baseline")
        subprocess.run(
            ["git", "-C", REPO, "worktree", "add", "--detach", "--quiet", tree, rev], check=True
        )
        try:
            for _ in range(args.rounds):
                for key, value in _run(tree, args.steps).items():
                    before.setdefault(key, []).append(value)
                for key, value in _run(REPO, args.steps).items():
                    after.setdefault(key, []).append(value)
        finally:
            subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", tree], check=False)
    print(f"CPU flags: {' '.join(flags) or 'none of avx2/avx512'}; one thread")
    print(
        f"before = {rev} (--baseline-rev), after = working tree; per-step median of "
        f"{args.steps} steps, best of {args.rounds} rounds"
    )
    print("| running requests | step | before (ms) | after (ms) | before / after |")
    print("|---|---|---|---|---|")
    for n in SIZES:
        for mixed in (False, True):
            b, a = min(before[f"{n}/{mixed}"]), min(after[f"{n}/{mixed}"])
            kind = "decode + 1/4 prefilling 64" if mixed else "decode"
            print(f"| {n} | {kind} | {b * 1e3:.3f} | {a * 1e3:.3f} | {b / a:.2f}x |")


if __name__ == "__main__":
    main()
