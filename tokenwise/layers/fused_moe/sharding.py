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
Under tensor parallelism (no DP) every TP rank holds its slice of every expert's intermediate
dimension, and the layer all-reduces the partial sums (every TP rank has the same tokens).
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
        ranks, rank = parallel.data_parallel_size, parallel.data_parallel_rank
        tp_size = get_tp_size()
        if tp_size > 1:
            if ranks > 1:
                raise NotImplementedError(
                    f"DP x TP for MoE layers is not yet supported (data_parallel_size={ranks}, "
                    f"tensor_parallel_size={tp_size}): use one of the two"
                )
            if intermediate_size % tp_size:
                raise ValueError(
                    f"the expert intermediate size ({intermediate_size}) is not divisible by "
                    f"tensor_parallel_size ({tp_size})"
                )
            per_rank = intermediate_size // tp_size
            start = get_tp_rank() * per_rank
            return cls(num_experts, intermediate_size, 0, num_experts, start, per_rank)
        if ranks == 1:
            return cls(num_experts, intermediate_size, 0, num_experts, 0, intermediate_size)
        if parallel.enable_expert_parallel:
            if num_experts % ranks:
                raise ValueError(
                    f"expert parallelism needs num_experts ({num_experts}) divisible by "
                    f"data_parallel_size ({ranks})"
                )
            per_rank = num_experts // ranks
            return cls(
                num_experts, intermediate_size, rank * per_rank, per_rank, 0, intermediate_size
            )
        if intermediate_size % ranks:
            raise ValueError(
                f"sharding MoE experts over data_parallel_size ({ranks}) without expert "
                f"parallelism needs the expert intermediate size ({intermediate_size}) divisible "
                f"by it (num_experts={num_experts}); set enable_expert_parallel=True instead?"
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
