"""The parts of `benchmarks/gpu_check.py`, in the order they run (most wanted figures first,
so a run that hits the global deadline loses the least)."""

from __future__ import annotations

from benchmarks.gpu_check_parts import engine_parts, kernels, parity, speculative, streams
from benchmarks.gpu_check_parts.plan import Part

PLAN: list[Part] = [
    *parity.PARTS,
    *engine_parts.PARTS,
    *kernels.PARTS,
    *speculative.PARTS,
    *streams.PARTS,
    *engine_parts.LATE_PARTS,
]
