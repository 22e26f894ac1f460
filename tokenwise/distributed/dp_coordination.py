"""Agreeing on one step's batch shape across data-parallel ranks.

Each DP rank schedules its own requests, but MoE layers exchange tokens between ranks, so every
rank must run the same number of forward passes with compatible shapes: the same micro-batching
decision, the same graph mode, and (when graphs or micro-batches need it) the same padded size.
Rather than electing a leader, every rank contributes one column of a small matrix and a single
SUM all-reduce hands the full matrix to all ranks; each then applies the same deterministic rule
to the same numbers, so they cannot disagree and one collective per step suffices.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tokenwise.config import CUDAGraphMode, ParallelConfig
from tokenwise.distributed.parallel_state import get_dp_group
from tokenwise.distributed.ubatching import check_ubatch_thresholds

__all__ = [
    "DPStepCounts",
    "coordinate_batch_across_dp",
    "coordinate_step_across_dp",
    "decide_from_dp_matrix",
    "needs_dp_counts",
]

# Rows of the coordination matrix (one column per DP rank).
_UNPADDED, _PADDED, _WANTS_UBATCH, _ALLOWS_PADDING, _GRAPH_MODE = range(5)
_NUM_ROWS = 5


def _graph_mode_int(cudagraph_mode: int | CUDAGraphMode) -> int:
    """The mode as the int that travels in the matrix (min over ranks = the most conservative)."""
    value = cudagraph_mode.value if isinstance(cudagraph_mode, CUDAGraphMode) else cudagraph_mode
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(
            "cudagraph_mode must be an int or a run-time CUDAGraphMode (NONE, PIECEWISE, FULL), "
            f"got {cudagraph_mode!r}"
        )
    return value


def decide_from_dp_matrix(matrix: torch.Tensor) -> tuple[bool, torch.Tensor, int]:
    """The rule every rank applies to the gathered `[5, dp_size]` matrix.

    Separate from the collective so it can be checked without processes.
    - Micro-batch only if every rank wants to and, after padding everyone to the largest padded
      count M (split at M // 2), the smallest rank (m real tokens) still has a real token in its
      second micro-batch; `M // 2 >= m` would make that micro-batch pure padding.
    - Pad everyone to M when all ranks allow it, and always when micro-batching, since the
      micro-batches of all ranks must line up.
    - Graph mode: the minimum, so no rank is asked to replay a graph kind it cannot use.
    """
    if matrix.dim() != 2 or matrix.shape[0] != _NUM_ROWS or matrix.shape[1] < 1:
        raise ValueError(f"expected a [{_NUM_ROWS}, dp_size] matrix, got {tuple(matrix.shape)}")
    padded = matrix[_PADDED].to(torch.int64)
    max_padded = int(padded.max())
    min_unpadded = int(matrix[_UNPADDED].min())
    should_ubatch = bool((matrix[_WANTS_UBATCH] == 1).all()) and max_padded // 2 < min_unpadded
    pad = should_ubatch or bool((matrix[_ALLOWS_PADDING] == 1).all())
    num_tokens_after_padding = torch.full_like(padded, max_padded) if pad else padded.clone()
    return should_ubatch, num_tokens_after_padding, int(matrix[_GRAPH_MODE].min())


def coordinate_batch_across_dp(
    num_tokens_unpadded: int,
    allow_microbatching: bool,
    allow_dp_padding: bool,
    parallel_config: ParallelConfig,
    num_tokens_padded: int | None = None,
    uniform_decode: bool | None = None,
    num_scheduled_tokens_per_request: Sequence[int] | None = None,
    cudagraph_mode: int | CUDAGraphMode = 0,
) -> tuple[bool, torch.Tensor | None, int]:
    """Decide micro-batching, padding and graph mode for this step, identically on all DP ranks.

    Every DP rank must call this for every step (it is a collective over the DP gloo group),
    including ranks with nothing to run, which should pass their dummy batch size.
    `num_tokens_padded` is this rank's own padded size (e.g. its graph capture size) and
    defaults to the unpadded count. `num_scheduled_tokens_per_request`, when given, is only
    checked against `num_tokens_unpadded` to catch a caller passing mismatched counts.

    Returns `(should_ubatch, num_tokens_after_padding, synced_cudagraph_mode)`: the tensor is a
    CPU int tensor with one count per DP rank (None with DP size 1, where nothing is exchanged),
    and the mode is an int (convert with `CUDAGraphMode(...)`).
    """
    mode = _graph_mode_int(cudagraph_mode)
    if parallel_config.data_parallel_size == 1:
        return False, None, mode

    if num_tokens_padded is None:
        num_tokens_padded = num_tokens_unpadded
    if not 0 <= num_tokens_unpadded <= num_tokens_padded:
        raise ValueError(
            f"need 0 <= num_tokens_unpadded ({num_tokens_unpadded}) <= num_tokens_padded "
            f"({num_tokens_padded})"
        )
    if num_scheduled_tokens_per_request is not None:
        total = sum(int(n) for n in num_scheduled_tokens_per_request)
        if total != num_tokens_unpadded:
            raise ValueError(
                f"num_scheduled_tokens_per_request sums to {total}, but num_tokens_unpadded is "
                f"{num_tokens_unpadded}"
            )
    wants_ubatch = allow_microbatching and check_ubatch_thresholds(
        parallel_config, num_tokens_unpadded, uniform_decode
    )
    return decide_from_dp_matrix(
        _gather_matrix(
            parallel_config,
            num_tokens_unpadded,
            num_tokens_padded,
            wants_ubatch,
            allow_dp_padding,
            mode,
        )
    )


def _gather_matrix(
    parallel_config: ParallelConfig,
    unpadded: int,
    padded: int,
    wants_ubatch: bool,
    allows_padding: bool,
    mode: int,
) -> torch.Tensor:
    """The one collective: this rank's column in, every rank's columns out."""
    matrix = torch.zeros(_NUM_ROWS, parallel_config.data_parallel_size, dtype=torch.int32)
    column = matrix[:, parallel_config.data_parallel_rank]
    column[_UNPADDED] = unpadded
    column[_PADDED] = padded
    column[_WANTS_UBATCH] = int(wants_ubatch)
    column[_ALLOWS_PADDING] = int(allows_padding)
    column[_GRAPH_MODE] = mode
    dist.all_reduce(matrix, op=dist.ReduceOp.SUM, group=get_dp_group())
    return matrix


def needs_dp_counts(parallel_config: ParallelConfig) -> bool:
    """Whether a forward pass needs every DP rank's token count: DP with an MoE (or not yet
    known) model, the same condition under which `set_forward_context` would coordinate."""
    return parallel_config.data_parallel_size > 1 and parallel_config.is_moe_model is not False


@dataclass(frozen=True)
class DPStepCounts:
    """One step's coordinated token counts, from the step's single collective.

    `num_tokens_across_dp` holds every rank's real (unpadded) count. When `should_ubatch`, each
    rank runs two micro-batches cut at `ubatch_split` (half the largest rank's count, the same
    on every rank); the rule guarantees `ubatch_split` is below every rank's count, so every
    rank's first micro-batch has exactly `ubatch_split` tokens and its second the rest. Both
    micro-batches' counts therefore follow from this one matrix, and the second needs no
    collective of its own (`ubatch_counts`).
    """

    should_ubatch: bool
    num_tokens_across_dp: torch.Tensor
    ubatch_split: int

    def ubatch_counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank's token count in the first and in the second micro-batch."""
        if not self.should_ubatch:
            raise RuntimeError("ubatch_counts() of a step the DP ranks agreed not to split")
        first = torch.full_like(self.num_tokens_across_dp, self.ubatch_split)
        return first, self.num_tokens_across_dp - self.ubatch_split


def coordinate_step_across_dp(
    num_tokens: int,
    parallel_config: ParallelConfig,
    allow_microbatching: bool = False,
    uniform_decode: bool | None = None,
) -> DPStepCounts | None:
    """The engine's once-per-step coordination: None when no forward pass needs DP counts.

    The same collective and rule as `coordinate_batch_across_dp` (no DP padding: each rank runs
    its own tokens), but it also returns every rank's unpadded count, which is what the forward
    context's `num_tokens_across_dp` must be and what the micro-batches' counts derive from.
    Every DP rank must call it once per forward step, idle ranks with their dummy batch size.
    """
    if not needs_dp_counts(parallel_config):
        return None
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    wants_ubatch = allow_microbatching and check_ubatch_thresholds(
        parallel_config, num_tokens, uniform_decode
    )
    matrix = _gather_matrix(parallel_config, num_tokens, num_tokens, wants_ubatch, False, 0)
    should_ubatch, padded, _ = decide_from_dp_matrix(matrix)
    split = int(padded.max()) // 2 if should_ubatch else 0
    return DPStepCounts(should_ubatch, matrix[_UNPADDED].clone(), split)
