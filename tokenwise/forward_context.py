"""The forward context: per-batch state that reaches layers without passing through `forward`.

Model code is written as if it processed one stream of tokens. Everything that depends on how
the engine batched this step — attention metadata, which KV cache to use, how many tokens each
data-parallel rank runs, which captured graph fits — is installed here by the engine for the
duration of one forward pass and read by the few layers that need it (attention, MoE) by name.

The current context lives in a `contextvars.ContextVar` rather than a module global: each thread
starts with no context and each asyncio task works on a copy, so two engines driven from two
threads (or two tasks) never see each other's batch.
"""

from __future__ import annotations

import contextvars
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from tokenwise.batchsize_stats import (
    batchsize_forward_stats,
    get_batchsize_forward_time_stats,
    reset_batchsize_forward_time_stats,
)
from tokenwise.config import CUDAGraphMode, EngineConfig, ParallelConfig

__all__ = [
    "BatchDescriptor",
    "DPMetadata",
    "ForwardContext",
    "create_forward_context",
    "current_forward_context",
    "get_batchsize_forward_time_stats",
    "get_forward_context",
    "is_forward_context_available",
    "override_forward_context",
    "reset_batchsize_forward_time_stats",
    "set_forward_context",
]


class BatchDescriptor(NamedTuple):
    """Key for graph dispatch: describes the *padded* batch, with as few fields as needed."""

    num_tokens: int
    num_reqs: int | None = None
    uniform: bool = False
    has_lora: bool = False

    def relax_for_mixed_batch_cudagraphs(self) -> BatchDescriptor:
        """The key a mixed-batch (piecewise) graph is captured under: only sizes matter."""
        return self._replace(num_reqs=None, uniform=False)


def _sp_expanded_sizes(num_tokens_across_dp: torch.Tensor, sp: int) -> list[int]:
    if sp < 1:
        raise ValueError(f"sequence parallel size must be >= 1, got {sp}")
    return [math.ceil(int(t) / sp) for t in num_tokens_across_dp.tolist() for _ in range(sp)]


@dataclass
class DPMetadata:
    """Token counts of every data-parallel rank for this step (MoE layers need them)."""

    max_tokens_across_dp_cpu: torch.Tensor
    num_tokens_across_dp_cpu: torch.Tensor
    local_sizes: list[int] | None = None

    @staticmethod
    def make(
        parallel_config: ParallelConfig,
        num_tokens: int,
        num_tokens_across_dp_cpu: torch.Tensor | None,
    ) -> DPMetadata:
        """Wrap already-coordinated counts. No collective runs here."""
        dp_size = parallel_config.data_parallel_size
        if dp_size <= 1:
            raise ValueError(f"DPMetadata needs data_parallel_size > 1, got {dp_size}")
        if num_tokens_across_dp_cpu is None:
            raise ValueError(
                "DPMetadata.make needs num_tokens_across_dp_cpu (one count per DP rank); "
                "obtain it with tokenwise.distributed.coordinate_batch_across_dp"
            )
        rank = parallel_config.data_parallel_rank
        if num_tokens_across_dp_cpu.numel() != dp_size:
            raise ValueError(
                f"num_tokens_across_dp_cpu has {num_tokens_across_dp_cpu.numel()} entries, "
                f"expected data_parallel_size={dp_size}"
            )
        at_rank = int(num_tokens_across_dp_cpu[rank])
        if at_rank != num_tokens:
            raise ValueError(
                f"num_tokens_across_dp_cpu[{rank}] = {at_rank} does not match this rank's "
                f"num_tokens = {num_tokens}"
            )
        return DPMetadata(torch.max(num_tokens_across_dp_cpu), num_tokens_across_dp_cpu)

    @contextmanager
    def sp_local_sizes(self, sequence_parallel_size: int) -> Iterator[list[int]]:
        """Each rank's count split over `sp` sequence-parallel shards: ceil(t / sp), sp times."""
        self.local_sizes = _sp_expanded_sizes(self.num_tokens_across_dp_cpu, sequence_parallel_size)
        try:
            yield self.local_sizes
        finally:
            self.local_sizes = None

    @contextmanager
    def chunked_sizes(
        self, sequence_parallel_size: int, max_chunk_size_per_rank: int, chunk_idx: int
    ) -> Iterator[list[int]]:
        """Sizes of chunk `chunk_idx` when every rank processes at most `max_chunk` per chunk.

        A rank that has already finished still reports 1 token, so that it keeps joining the
        collective and all ranks stay in lock-step.
        """
        sizes = _sp_expanded_sizes(self.num_tokens_across_dp_cpu, sequence_parallel_size)
        offset = max_chunk_size_per_rank * chunk_idx
        self.local_sizes = [max(1, min(max_chunk_size_per_rank, s - offset)) for s in sizes]
        try:
            yield self.local_sizes
        finally:
            self.local_sizes = None

    def get_chunk_sizes_across_dp_rank(self) -> list[int]:
        if self.local_sizes is None:
            raise RuntimeError(
                "local_sizes is only set inside DPMetadata.sp_local_sizes() or chunked_sizes()"
            )
        return self.local_sizes

    def cu_tokens_across_sp(self, sequence_parallel_size: int) -> torch.Tensor:
        """Inclusive cumulative sum of the sp-expanded counts (sp = 1: plain cumsum)."""
        sizes = _sp_expanded_sizes(self.num_tokens_across_dp_cpu, sequence_parallel_size)
        return torch.cumsum(torch.tensor(sizes, dtype=torch.int64), dim=0)


@dataclass
class ForwardContext:
    """What one forward pass knows about its batch. Built by the engine, read by layers."""

    no_compile_layers: dict[str, Any]
    attn_metadata: Any
    virtual_engine: int
    dp_metadata: DPMetadata | None = None
    cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE
    batch_descriptor: BatchDescriptor | None = None
    ubatch_slices: list[Any] | None = None
    additional_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        mode = self.cudagraph_runtime_mode
        if not isinstance(mode, CUDAGraphMode) or not mode.valid_runtime_modes():
            raise ValueError(
                "cudagraph_runtime_mode must be NONE, PIECEWISE or FULL for a forward pass, "
                f"got {mode!r}"
            )


_current: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar(
    "tokenwise_forward_context", default=None
)


def get_forward_context() -> ForwardContext:
    ctx = _current.get()
    if ctx is None:
        raise RuntimeError(
            "No forward context is set. Layers that read batch state (attention, MoE) must run "
            "inside `with set_forward_context(attn_metadata, config): model(...)` (or "
            "`override_forward_context(ctx)`); note that a new thread starts with no context."
        )
    return ctx


def is_forward_context_available() -> bool:
    return _current.get() is not None


def current_forward_context() -> ForwardContext | None:
    """The installed context, or None: one lookup for callers on the per-layer path that
    would otherwise ask `is_forward_context_available()` and then `get_forward_context()`."""
    return _current.get()


def create_forward_context(
    attn_metadata: Any,
    config: EngineConfig,
    virtual_engine: int = 0,
    dp_metadata: DPMetadata | None = None,
    cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE,
    batch_descriptor: BatchDescriptor | None = None,
    ubatch_slices: list[Any] | None = None,
    additional_kwargs: dict[str, Any] | None = None,
) -> ForwardContext:
    """Build (but do not install) a context sharing the config's static layer registry."""
    return ForwardContext(
        no_compile_layers=config.compilation.static_forward_context,
        attn_metadata=attn_metadata,
        virtual_engine=virtual_engine,
        dp_metadata=dp_metadata,
        cudagraph_runtime_mode=cudagraph_runtime_mode,
        batch_descriptor=batch_descriptor,
        ubatch_slices=ubatch_slices,
        additional_kwargs=additional_kwargs or {},
    )


@contextmanager
def override_forward_context(ctx: ForwardContext | None) -> Iterator[None]:
    """Install `ctx` for the body and restore whatever was current before (also on error)."""
    token = _current.set(ctx)
    try:
        yield
    finally:
        _current.reset(token)


def _num_tokens_from_metadata(attn_metadata: Any) -> int | None:
    """Token count of a step from its metadata (one object, a per-layer dict, or a list)."""
    if isinstance(attn_metadata, list):
        counts = [_num_tokens_from_metadata(md) for md in attn_metadata]
        return None if any(c is None for c in counts) else sum(counts)  # type: ignore[misc]
    if isinstance(attn_metadata, dict):
        first = next(iter(attn_metadata.values()), None)
        return None if first is None else _num_tokens_from_metadata(first)
    prefill = getattr(attn_metadata, "num_prefill_tokens", None)
    decode = getattr(attn_metadata, "num_decode_tokens", None)
    if prefill is None or decode is None:
        return None
    return int(prefill) + int(decode)


def _synchronize_device() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


@contextmanager
def set_forward_context(
    attn_metadata: Any,
    config: EngineConfig,
    virtual_engine: int = 0,
    num_tokens: int | None = None,
    num_tokens_across_dp: torch.Tensor | None = None,
    cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE,
    batch_descriptor: BatchDescriptor | None = None,
    ubatch_slices: list[Any] | None = None,
) -> Iterator[ForwardContext]:
    """Install the context for one forward pass.

    With data parallelism and an MoE (or unknown) model, every DP rank must enter this together:
    when `num_tokens_across_dp` is not given it is obtained with a collective. Dense models run
    no collective and get no DP metadata. Yields the installed context.
    """
    track_time = batchsize_forward_stats.enabled and attn_metadata is not None
    if num_tokens is None and attn_metadata is not None:
        num_tokens = _num_tokens_from_metadata(attn_metadata)

    dp_metadata = None
    parallel = config.parallel
    if (
        parallel.data_parallel_size > 1
        and parallel.is_moe_model is not False
        and (attn_metadata is not None or num_tokens is not None)
    ):
        if num_tokens is None:
            raise ValueError(
                "set_forward_context with data parallelism needs num_tokens (it could not be "
                "derived from attn_metadata)"
            )
        if num_tokens_across_dp is None:
            from tokenwise.distributed.dp_coordination import coordinate_batch_across_dp

            _, num_tokens_across_dp, _ = coordinate_batch_across_dp(
                num_tokens_unpadded=num_tokens,
                allow_microbatching=False,
                allow_dp_padding=False,
                parallel_config=parallel,
            )
        dp_metadata = DPMetadata.make(parallel, num_tokens, num_tokens_across_dp)

    if cudagraph_runtime_mode != CUDAGraphMode.NONE and num_tokens is not None:
        batch_descriptor = batch_descriptor or BatchDescriptor(num_tokens)

    ctx = create_forward_context(
        attn_metadata,
        config,
        virtual_engine=virtual_engine,
        dp_metadata=dp_metadata,
        cudagraph_runtime_mode=cudagraph_runtime_mode,
        batch_descriptor=batch_descriptor,
        ubatch_slices=ubatch_slices,
    )
    # The clock starts here, after the DP collective: the statistic is the cost of the body
    # (the model) at this batch size, not the time spent waiting for slower DP ranks.
    start = time.perf_counter() if track_time else 0.0
    with override_forward_context(ctx):
        yield ctx
    # Only a pass that completed is timed: a failed one says nothing about batch-size cost.
    if track_time and num_tokens is not None:
        _synchronize_device()
        batchsize_forward_stats.record(num_tokens, (time.perf_counter() - start) * 1000.0)
