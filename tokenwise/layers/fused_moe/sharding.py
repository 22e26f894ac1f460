"""Which part of an MoE layer's expert weights one data-parallel rank holds.

Under data parallelism every rank runs attention on its own requests, but storing every expert
on every rank would multiply the (dominant) expert memory by the rank count. So the experts are
split over the DP ranks, in one of two ways:

- expert parallelism (`enable_expert_parallel=True`): rank r holds whole experts
  `[r*E/n, (r+1)*E/n)`; a token's pairs routed elsewhere are computed by their owners.
- otherwise, every rank holds every expert but only its `I/n` slice of the intermediate
  dimension (gate and up rows, down columns). SwiGLU acts element-wise on the intermediate
  dimension, so the down projection of a slice is an exact partial sum of the full output.

Either way a rank's output is a partial sum, which the DP dispatch/combine adds up over ranks.
Tensor parallelism splits the same way one level further: with DP x TP there are `dp * tp`
shards (process `dp_rank * tp + tp_rank` holds one); the DP exchange sums over the DP ranks
sharing a TP rank, and the TP all-reduce then sums over the TP ranks (which share tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenwise.config import ParallelConfig
from tokenwise.distributed.tp_state import get_tp_rank, get_tp_size


@dataclass(frozen=True)
class ExpertShard:
    num_experts: int
    intermediate_size: int
    first_expert: int
    num_local_experts: int
    intermediate_start: int
    local_intermediate_size: int

    @classmethod
    def for_rank(
        cls, parallel: ParallelConfig, num_experts: int, intermediate_size: int
    ) -> ExpertShard:
        """This process's part: one of `dp * tp` shards, number `dp_rank * tp + tp_rank`."""
        dp, tp = parallel.data_parallel_size, get_tp_size()
        ranks, rank = dp * tp, parallel.data_parallel_rank * tp + get_tp_rank()
        sizes = [f"data_parallel_size ({dp})"] * (dp > 1) + [f"tensor_parallel_size ({tp})"] * (
            tp > 1
        )
        layout = " * ".join(sizes)
        if ranks == 1:
            return cls(num_experts, intermediate_size, 0, num_experts, 0, intermediate_size)
        if parallel.enable_expert_parallel:
            if num_experts % ranks:
                raise ValueError(
                    f"expert parallelism needs num_experts ({num_experts}) divisible by {layout}"
                )
            per_rank = num_experts // ranks
            return cls(
                num_experts, intermediate_size, rank * per_rank, per_rank, 0, intermediate_size
            )
        if intermediate_size % ranks:
            raise ValueError(
                f"sharding MoE experts {ranks} ways ({layout}) without expert parallelism needs the "
                f"expert intermediate size ({intermediate_size}) divisible by {ranks} "
                f"(num_experts={num_experts}); set enable_expert_parallel=True instead?"
            )
        per_rank = intermediate_size // ranks
        return cls(num_experts, intermediate_size, 0, num_experts, rank * per_rank, per_rank)

    @property
    def is_sharded(self) -> bool:
        return (
            self.num_local_experts != self.num_experts
            or self.local_intermediate_size != self.intermediate_size
        )

    def local_expert(self, expert_id: int) -> int | None:
        """The local index of global expert `expert_id`, or None when another rank holds it."""
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"expert id {expert_id} is out of range [0, {self.num_experts})")
        local = expert_id - self.first_expert
        return local if 0 <= local < self.num_local_experts else None

    def intermediate_slice(self) -> slice:
        return slice(
            self.intermediate_start, self.intermediate_start + self.local_intermediate_size
        )
