"""Naive dispatch and combine: how an MoE layer runs when its experts are spread over DP ranks.

Each data-parallel rank runs attention on its own requests, but under DP an MoE layer's experts
are sharded over the ranks (whole experts with expert parallelism, a slice of every expert's
intermediate dimension without). So every rank needs every rank's tokens: the layer all-gathers
the hidden states (and router logits) of all ranks, each rank computes its partial contribution
for all of them, and a reduce-scatter sums the partials and hands every rank back its own rows.

Ranks have different token counts; the forward context's `DPMetadata` carries them, so no extra
collective is needed to learn them. A rank with one huge prefill would make every rank gather
all of it at once, so the exchange runs in chunks of at most `TOKENWISE_MOE_DP_CHUNK_SIZE`
tokens per rank (`DPMetadata.chunked_sizes`); every rank runs the same number of chunks (set by
the largest rank), and a rank that has run out of tokens joins with one dummy row.

Both collectives are issued asynchronously and waited for through `dbo.wait_collective`
(bounded, and where `TOKENWISE_MOE_COLLECTIVE_DELAY_MS` injects latency). Between issue and wait
sits a DBO yield point: when the step runs as two overlapped micro-batches (`dbo.py`), the other
micro-batch computes while this one's exchange is in flight; otherwise the yield is a no-op.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from tokenwise import envs
from tokenwise.config import ParallelConfig
from tokenwise.distributed.dbo import dbo_record, dbo_yield, wait_collective
from tokenwise.distributed.parallel_state import get_dp_device_group

if TYPE_CHECKING:  # the forward context sits above this module; only its type is needed
    from tokenwise.forward_context import DPMetadata

__all__ = ["DEFAULT_MOE_DP_CHUNK_SIZE", "moe_dp_chunk_size", "naive_dispatch_combine"]

DEFAULT_MOE_DP_CHUNK_SIZE = 256
_CHUNK_ENV = "TOKENWISE_MOE_DP_CHUNK_SIZE"

# torch 2.13 renamed the fixed-size collectives (the old names warn); older torch has only those.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# The partial MoE output of this rank's experts for `(hidden_states, router_logits)` rows.
LocalExperts = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def moe_dp_chunk_size() -> int:
    """Tokens per rank per exchange, from `TOKENWISE_MOE_DP_CHUNK_SIZE` (default 256)."""
    raw = envs.get(_CHUNK_ENV)
    if not raw:
        return DEFAULT_MOE_DP_CHUNK_SIZE
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{_CHUNK_ENV} must be a positive integer, got {raw!r}")
    return value


def naive_dispatch_combine(
    hidden_states: torch.Tensor,
    router_logits: torch.Tensor,
    local_experts: LocalExperts,
    dp_metadata: DPMetadata,
    parallel_config: ParallelConfig,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """This rank's MoE output: gather all ranks' tokens, run local experts, sum back.

    Every DP rank must call this for the same layer at the same time (it is a collective).
    """
    chunk = chunk_size or moe_dp_chunk_size()
    rank = parallel_config.data_parallel_rank
    num_local = hidden_states.shape[0]
    if num_local != int(dp_metadata.num_tokens_across_dp_cpu[rank]):
        raise ValueError(
            f"MoE layer got {num_local} tokens but the forward context says this rank "
            f"(DP rank {rank}) runs {int(dp_metadata.num_tokens_across_dp_cpu[rank])}"
        )
    # Hidden states and logits travel together: one gather per chunk instead of two.
    packed = torch.cat([hidden_states, router_logits.to(hidden_states.dtype)], dim=-1)
    hidden_size = hidden_states.shape[-1]
    group = get_dp_device_group()
    num_chunks = max(1, math.ceil(int(dp_metadata.max_tokens_across_dp_cpu) / chunk))
    out = hidden_states.new_empty(hidden_states.shape)
    for idx in range(num_chunks):
        with dp_metadata.chunked_sizes(1, chunk, idx):
            sizes = dp_metadata.get_chunk_sizes_across_dp_rank()
            start = idx * chunk
            real = max(0, min(chunk, num_local - start))
            mine = packed[start : start + real]
            if real == 0:  # out of tokens: one dummy row keeps the collective in step
                mine = packed.new_zeros(1, packed.shape[-1])
            gathered = _all_gather_varlen(mine, sizes, group)
            partial = local_experts(gathered[:, :hidden_size], gathered[:, hidden_size:])
            combined = _reduce_scatter_varlen(partial, sizes, rank, group)
            if real:
                out[start : start + real] = combined[:real]
    return out


def _all_gather_varlen(
    local: torch.Tensor, sizes: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """Concatenate every rank's rows (rank order); ranks pad to the largest count to exchange."""
    width = max(sizes)
    padded = local.new_zeros(width, local.shape[-1])
    padded[: local.shape[0]] = local
    buffer = local.new_empty(len(sizes) * width, local.shape[-1])
    work = _all_gather(buffer, padded, group=group, async_op=True)
    _issued_then_waited(work, "dispatch", local.device.type == "cpu")
    parts = buffer.view(len(sizes), width, -1)
    return torch.cat([parts[r, :n] for r, n in enumerate(sizes)])


def _reduce_scatter_varlen(
    partial: torch.Tensor, sizes: list[int], rank: int, group: dist.ProcessGroup
) -> torch.Tensor:
    """Sum every rank's partial result for this rank's rows, and only those."""
    width = max(sizes)
    padded = partial.new_zeros(len(sizes), width, partial.shape[-1])
    for r, part in enumerate(partial.split(sizes)):
        padded[r, : part.shape[0]] = part
    mine = partial.new_empty(width, partial.shape[-1])
    flat = padded.view(len(sizes) * width, -1)
    work = _reduce_scatter(mine, flat, group=group, async_op=True)
    _issued_then_waited(work, "combine", partial.device.type == "cpu")
    return mine[: sizes[rank]]


def _issued_then_waited(work: Any, what: str, on_cpu: bool) -> None:
    """The yield point between an issued collective and its wait (see the module doc)."""
    issued_at = time.perf_counter()
    dbo_record("issue", what)
    dbo_yield(what)
    wait_collective(work, issued_at, f"MoE {what}", on_cpu)
