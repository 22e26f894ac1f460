"""Running one step as two micro-batches: overlapped (DBO threads) or one after the other.

The runner decides, with the other DP ranks, to split a step (`dp_coordination`); this module
runs the split. Each micro-batch gets its own forward context (its slice of the attention
metadata and its DP counts, both fixed by the step's one coordination) and runs the model on
its tokens. With dual-batch overlap (the default) the two run on two threads that take turns
at the MoE exchange (`tokenwise.distributed.dbo`), so one's communication hides under the
other's compute; `TOKENWISE_DBO_SEQUENTIAL=1` runs them one after the other on the calling
thread instead (the behaviour before DBO, kept for comparison and debugging). Both orders give
the same result: micro-batch 0 runs each layer's attention before micro-batch 1 does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tokenwise import envs
from tokenwise.attention.metadata import AttentionMetadata
from tokenwise.attention.ubatch_metadata import split_metadata_by_layer
from tokenwise.config import EngineConfig
from tokenwise.distributed.dbo import DualBatchRunner
from tokenwise.distributed.dp_coordination import DPStepCounts
from tokenwise.distributed.ubatching import create_ubatch_slices
from tokenwise.forward_context import set_forward_context
from tokenwise.runner.input_batch import StepInputs

__all__ = ["dbo_sequential", "run_ubatches"]

_SEQUENTIAL_ENV = "TOKENWISE_DBO_SEQUENTIAL"

# What `run_ubatches` returns besides the hidden states: the DBO event trace (None when
# the micro-batches ran sequentially).
Trace = list[tuple[int, str, str]] | None


def dbo_sequential() -> bool:
    """Whether `TOKENWISE_DBO_SEQUENTIAL` asks for micro-batches without overlap."""
    raw = envs.get(_SEQUENTIAL_ENV).strip().lower()
    if raw not in ("", "0", "1", "false", "true"):
        raise ValueError(f"{_SEQUENTIAL_ENV} must be 0 or 1, got {raw!r}")
    return raw in ("1", "true")


def run_ubatches(
    model: Callable[..., torch.Tensor],
    config: EngineConfig,
    step: StepInputs,
    attn_metadata: dict[str, AttentionMetadata],
    counts: DPStepCounts,
) -> tuple[torch.Tensor, Trace]:
    """The step's hidden states, computed as two micro-batches cut at `counts.ubatch_split`.

    Every rank's first micro-batch has `ubatch_split` tokens and its second the rest of its
    own count (`DPStepCounts.ubatch_counts`), so no micro-batch coordinates again.
    """
    slices = create_ubatch_slices(step.query_lens_np.tolist(), counts.ubatch_split)
    pieces = []
    for ubatch, across in zip(slices, counts.ubatch_counts(), strict=True):
        # Split on the calling thread: deterministic, and errors surface before any thread.
        pieces.append((ubatch, split_metadata_by_layer(attn_metadata, ubatch), across))

    def job(ubatch: Any, metadata: Any, across: torch.Tensor) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            # Inference mode, the forward context and the current CUDA device are per
            # thread: install them here (the CUDA path is unverified: no GPU to test on).
            if step.input_ids.is_cuda:
                torch.cuda.set_device(step.input_ids.device)
            with (
                torch.inference_mode(),
                set_forward_context(
                    metadata,
                    config,
                    num_tokens=ubatch.num_tokens,
                    num_tokens_across_dp=across,
                    ubatch_slices=slices,
                ),
            ):
                tokens = ubatch.token_slice
                return model(step.input_ids[tokens], step.positions[tokens])

        return run

    jobs = [job(*piece) for piece in pieces]
    if dbo_sequential():
        return torch.cat([run() for run in jobs]), None
    runner = DualBatchRunner(len(jobs), rank=config.parallel.data_parallel_rank)
    outputs = runner.run(jobs)
    return torch.cat(outputs), runner.events
