"""Every "unverified on GPU" turned into a figure in one run of a lent GPU (< 8 minutes).

    python benchmarks/gpu_check.py                       # on a CUDA device: all parts
    python benchmarks/gpu_check.py --parts graph_modes,throughput
    python benchmarks/gpu_check.py --dry-run             # the whole plan on CPU, tiny shapes

The plan (`benchmarks/gpu_check_parts/`, `--list` prints it): HF parity of one tiny checkpoint
per architecture family, CUDA-graph modes against eager, the nano-vllm throughput workload,
int4 / fp8 / GPTQ kernels, speculative decoding (n-gram, draft model, EAGLE) at batch 1 and
32, the fp8 KV cache, DBO under DP=2, async scheduling, HF's continuous batching and a
per-step breakdown. Each part has a time bound and a failure in one never stops the others;
`--deadline` (default 480 s) skips what is left with a line saying so.

stdout is JSON lines only: `{"part", "figure", "value", "unit", "ok", ...}` per figure,
`{"part", "error"}` for a part that raised or ran past its bound, `{"part", "skipped": true,
"reason"}` for one that cannot run here. On a GPU the lines also go to `--output` (default
benchmarks/RESULTS.md, between this script's markers); a dry run writes nothing. Exit status 1
when a part failed or a figure was not ok.

`--dry-run` runs every part on the CPU with tiny shapes and a few tokens: CUDA graph modes by
the CPU's graph modes, `_scaled_mm` and tinygemm by their CPU routes; its figures mean nothing,
it shows the script works before a GPU is lent (tests/benchmarks/test_gpu_check.py runs it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the repository root: benchmarks.*, tests.*

from benchmarks.gpu_check_parts import PLAN  # noqa: E402
from benchmarks.gpu_check_parts.engine_parts import QWEN  # noqa: E402, F401 (test_gpu_path)
from benchmarks.gpu_check_parts.plan import Context, run_plan  # noqa: E402

NAMES = [p.name for p in PLAN]


def _parts(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = sorted(set(names) - set(NAMES))
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"--parts takes a comma-separated subset of {', '.join(NAMES)}; got {text!r}"
        )
    return names


def _positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="the whole plan on CPU, tiny shapes")
    p.add_argument("--parts", type=_parts, default=NAMES, help="comma-separated part names")
    p.add_argument("--list", action="store_true", help="print the plan and exit")
    p.add_argument("--deadline", type=_positive, default=480.0, help="seconds for all parts")
    p.add_argument("--output", default=os.path.join(HERE, "RESULTS.md"))
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def release() -> None:
    """Between parts: free what the last engine left (compiled code holds its model)."""
    import gc

    import torch

    gc.collect()
    torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def write_section(path: str, lines: list[str]) -> None:
    """Replace this script's section of `path` (between its markers), or append it."""
    begin, end = "<!-- gpu_check:begin -->", "<!-- gpu_check:end -->"
    section = "\n".join([begin, *lines, end])
    text = open(path).read() if os.path.exists(path) else ""
    if begin in text and end in text:
        text = text[: text.index(begin)] + section + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + section + "\n"
    with open(path, "w") as f:
        f.write(text)


def environment(device: str) -> str:
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (dry run)"
    return f"{name}, torch {torch.__version__}, triton {triton_version}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        for part in PLAN:
            print(json.dumps({"part": part.name, "seconds": part.seconds, "what": part.doc}))
        return 0
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        sys.exit(
            "gpu_check: error: no CUDA device here; this script measures the GPU path. Use "
            "--dry-run to run its plan on the CPU (tiny shapes, figures meaningless)."
        )
    device = "cpu" if args.dry_run else "cuda"
    env = environment(device)
    print(f"gpu_check: {env}", file=sys.stderr)
    options = {"num_prompts": args.num_prompts, "max_num_seqs": args.max_num_seqs,
               "max_num_batched_tokens": args.max_num_batched_tokens}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as workdir:
        ctx = Context(device, args.dry_run, workdir, args.seed, options)
        ok = run_plan([p for p in PLAN if p.name in args.parts], ctx, args.deadline, release)
    if not args.dry_run:
        stamp = datetime.date.today().isoformat()
        lines = [f"Measured on {env}, {stamp}, by `python benchmarks/gpu_check.py "
                 f"--parts {','.join(args.parts)}` (one JSON line per figure):", "", "```",
                 *(json.dumps(r, default=str) for r in ctx.lines), "```"]  # fmt: skip
        write_section(args.output, lines)
        print(f"gpu_check: wrote {args.output}", file=sys.stderr)
    if not ok:
        print("gpu_check: FAILED: a part failed or a figure was not ok", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
