"""Which CUDA graphs an engine captures, checked before anything slow happens.

`graph_setup` is what the model runner calls at construction: it rejects graph modes the engine
cannot run (with the parameter and the way out in the message), creates the capturer factory
that every graph of the engine shares (one memory pool), and the wrapper that the piecewise
backend puts around each compiled piece. `default_capture_sizes` derives the padded token counts
that get graphs from `max_num_seqs`.
"""

from __future__ import annotations

from typing import Any

import torch

from tokenwise.attention.backends.selector import get_attn_backend
from tokenwise.compilation.cpu_graph import cpu_capturer_factory
from tokenwise.compilation.cuda_graph import (
    CapturerFactory,
    CUDAGraphWrapper,
    cuda_capturer_factory,
)
from tokenwise.compilation.piecewise import PieceWrapper
from tokenwise.config import CUDAGraphMode, EngineConfig
from tokenwise.runner.verify_rows import GRAPH_VERIFY_METHODS

CPU_MAX_CAPTURE_SIZE = 8


def new_capturer_factory(device: torch.device) -> CapturerFactory:
    """Graph capturers for `device`: CUDA graphs, or on CPU recorded C kernels (`cpu_graph`)."""
    if device.type == "cpu":
        return cpu_capturer_factory()
    if device.type != "cuda":
        raise ValueError(
            f"graphs need a CUDA device or the CPU, but the engine runs on {device}; use "
            "cudagraph_mode=NONE there"
        )
    return cuda_capturer_factory(device)


def check_cudagraph_config(config: EngineConfig, backend: Any) -> None:
    """Reject graph modes this engine cannot run, before anything slow happens."""
    mode = config.compilation.cudagraph_mode
    if mode.requires_piecewise_compilation() and not config.compilation.use_compile:
        raise ValueError(
            f"cudagraph_mode={mode.name} captures the compiled pieces between attention calls, "
            "which needs compilation (use_compile=True, i.e. not enforce_eager)"
        )
    on_cpu = str(config.device).startswith("cpu")  # CPU graphs check each capture themselves
    if (
        mode.has_full_cudagraphs()
        and not on_cpu
        and not getattr(backend, "supports_full_cudagraph", False)
    ):
        raise ValueError(
            f"cudagraph_mode={mode.name} captures whole decode steps, but the "
            f"{getattr(backend, 'name', backend)!r} attention backend is not marked as "
            "capturable for whole steps; use cudagraph_mode=PIECEWISE, or the 'triton' "
            "backend (Triton on a CUDA device)"
        )


def graph_setup(
    config: EngineConfig, device: torch.device
) -> tuple[CapturerFactory | None, PieceWrapper | None]:
    """The capturer factory shared by all graphs, and the wrapper for compiled pieces.

    (None, None) when `cudagraph_mode` is NONE. Pieces are wrapped only when the mode has
    piecewise graphs; FULL-only modes capture the whole model in `CUDAGraphRunner`.
    """
    mode = config.compilation.cudagraph_mode
    if mode == CUDAGraphMode.NONE:
        return None, None
    check_cudagraph_config(config, get_attn_backend(config))
    factory = new_capturer_factory(device)
    if not mode.requires_piecewise_compilation():
        return factory, None

    def wrap_piece(index: int, compiled: Any, static_args: list[bool]) -> CUDAGraphWrapper:
        return CUDAGraphWrapper(
            compiled, CUDAGraphMode.PIECEWISE, factory, static_args, f"piece {index}"
        )

    return factory, wrap_piece


def graph_rows(config: EngineConfig) -> int:
    """The most decode rows a graph step may hold: `max_num_seqs`, or on CPU, under a proposer
    whose verifying steps replay decode graphs (`verify_rows.GRAPH_VERIFY_METHODS`), 1 + k rows
    a request, up to `CPU_MAX_CAPTURE_SIZE`. Without this one stream (`max_num_seqs=1`) would
    get a graph of one row only, and every verifying step would run eagerly."""
    seqs = config.scheduler.max_num_seqs
    spec = config.speculative
    if not str(config.device).startswith("cpu") or spec is None:
        return seqs
    if spec.method not in GRAPH_VERIFY_METHODS or spec.num_speculative_tokens is None:
        return seqs
    return max(seqs, min(CPU_MAX_CAPTURE_SIZE, seqs * (1 + spec.num_speculative_tokens)))


def default_capture_sizes(
    max_num_seqs: int, max_num_batched_tokens: int | None = None, device: str = "cuda"
) -> list[int]:
    """1, 2, 4, then every multiple of 8, up to `max_num_seqs` (itself included).

    Small sizes are where padding waste is relatively largest, so they get their own graphs;
    above 8 a step of 8 wastes at most 7 rows. A graph above the per-step token budget could
    never be used, so the sizes stop there. On CPU they stop at `CPU_MAX_CAPTURE_SIZE`: the
    C linear kernels take at most 8 rows, and above that the Python per step matters less.
    """
    if str(device).startswith("cpu"):
        max_num_seqs = min(max_num_seqs, CPU_MAX_CAPTURE_SIZE)
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    top = (
        max_num_seqs
        if max_num_batched_tokens is None
        else min(max_num_seqs, max_num_batched_tokens)
    )
    sizes = {s for s in (1, 2, 4) if s <= top} | set(range(8, top + 1, 8)) | {top}
    return sorted(sizes)
