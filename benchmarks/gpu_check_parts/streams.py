"""Parts about overlap: dual-batch overlap across two GPUs, and async scheduling.

DBO needs two data-parallel ranks with an expert-parallel MoE between them, one GPU each; on a
machine with fewer CUDA devices (every dry run) the part says so instead of faking a figure.
Its CPU form is benchmarks/dbo_overlap.py (two gloo processes, tests/distributed/test_dbo_dp.py);
a CUDA form (NCCL, one stream per micro-batch) is not written yet, so with two GPUs the part
still skips, naming that. Async scheduling (schedule step N+1 while step N
runs, vLLM's --async-scheduling) is not built yet: the part is in the plan so that the day it
is, the figure has its place, and until then every run shows it missing.
"""

from __future__ import annotations

from benchmarks.gpu_check_parts.plan import Context, Part, Skip


def dbo(ctx: Context) -> None:
    import torch

    count = torch.cuda.device_count() if ctx.device == "cuda" else 0
    if count < 2:
        raise Skip(f"DBO under DP=2 needs two CUDA devices; this machine has {count}")
    raise Skip(
        "DBO has no GPU benchmark yet: benchmarks/dbo_overlap.py runs its two ranks on CPU "
        "over gloo (a CUDA form, NCCL and one stream per micro-batch, is still to write)"
    )


def async_scheduling(ctx: Context) -> None:
    raise Skip("async scheduling is not built yet (issue #51, part 3): no figure to take")


PARTS = [
    Part("dbo", 5, dbo, "dual-batch overlap streams under DP=2"),
    Part("async_scheduling", 5, async_scheduling, "nano-vllm workload with async on/off"),
]
