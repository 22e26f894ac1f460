"""Data parallelism: the DP process group, per-step batch coordination and micro-batches."""

from __future__ import annotations

from tokenwise.distributed.dp_coordination import (
    DPStepCounts,
    coordinate_batch_across_dp,
    coordinate_step_across_dp,
    decide_from_dp_matrix,
)
from tokenwise.distributed.parallel_state import (
    destroy_dp_group,
    get_dp_group,
    init_dp_group,
    is_dp_group_initialized,
)
from tokenwise.distributed.ubatching import (
    UBatchSlice,
    check_ubatch_thresholds,
    create_ubatch_slices,
    pad_ubatch_slices,
    split_request_lengths,
)

__all__ = [
    "DPStepCounts",
    "UBatchSlice",
    "check_ubatch_thresholds",
    "coordinate_batch_across_dp",
    "coordinate_step_across_dp",
    "create_ubatch_slices",
    "decide_from_dp_matrix",
    "destroy_dp_group",
    "get_dp_group",
    "init_dp_group",
    "is_dp_group_initialized",
    "pad_ubatch_slices",
    "split_request_lengths",
]
