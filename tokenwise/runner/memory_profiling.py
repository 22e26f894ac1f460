"""How much GPU memory the KV cache may take (vLLM's `gpu_memory_utilization` semantics).

The engine may use `gpu_memory_utilization` of the device's *total* memory. Everything else it
needs is measured by a profiling run before the cache exists: one forward pass over the largest
batch a step can hold (`max_num_batched_tokens` tokens, with no KV cache: attention then runs
as one causal sequence), plus the logits and softmax of the most rows a step samples. The peak
memory PyTorch's allocator reserved during that run covers the weights and the activations;
memory held outside PyTorch's allocator (the CUDA context, other processes) is counted too, and
the model runner subtracts what its CUDA graphs take (measured by capturing them). What remains
of the budget is the KV cache.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from tokenwise.config import EngineConfig
from tokenwise.forward_context import set_forward_context

logger = logging.getLogger(__name__)

GiB = float(1 << 30)
# Kernels the first real steps load lazily (CUDA_MODULE_LOADING=LAZY: sampling, Triton decode
# variants, cuBLAS heuristics) sit outside PyTorch's allocator and after the profile: on an
# H100 (Qwen3-0.6B shape, FULL_AND_PIECEWISE) they added 0.12 GiB after the KV cache had taken
# the rest of the budget, leaving the process 0.02 GiB over `gpu_memory_utilization`.
LAZY_KERNEL_HEADROOM_BYTES = 256 << 20


def kv_cache_budget_bytes(
    total_bytes: int, gpu_memory_utilization: float, peak_bytes: int, non_torch_bytes: int = 0
) -> int:
    """`total * utilization - peak - non_torch`; an error naming the setting when <= 0."""
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    allowed = int(total_bytes * gpu_memory_utilization)
    budget = allowed - peak_bytes - non_torch_bytes
    if budget <= 0:
        raise ValueError(
            f"no memory left for the KV cache: gpu_memory_utilization={gpu_memory_utilization} "
            f"allows {allowed / GiB:.2f} GiB of {total_bytes / GiB:.2f} GiB, but the model's "
            f"weights and peak activations take {peak_bytes / GiB:.2f} GiB and "
            f"{non_torch_bytes / GiB:.2f} GiB are used outside PyTorch; raise "
            "gpu_memory_utilization (at most 1.0) or lower max_num_batched_tokens"
        )
    return budget


@torch.inference_mode()
def profile_run(model: Any, config: EngineConfig, device: torch.device) -> None:
    """One forward at the step token budget without a KV cache, then the sampling logits."""
    assert config.model is not None
    num_tokens = config.scheduler.max_num_batched_tokens
    max_len = config.model.max_model_len
    input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    positions = torch.arange(num_tokens, dtype=torch.int64, device=device) % max_len
    with set_forward_context(None, config, num_tokens=num_tokens):
        hidden = model(input_ids, positions)
    rows = min(config.scheduler.max_num_seqs, num_tokens)
    logits = model.compute_logits(hidden[:rows])
    torch.softmax(logits.float(), dim=-1)


def cuda_kv_cache_budget(model: Any, config: EngineConfig, device: torch.device) -> int:
    """Bytes for the KV cache on `device`, measured with a profiling run."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    profile_run(model, config, device)
    torch.cuda.synchronize(device)
    # Reserved, not allocated: the allocator keeps the profile's segments cached, so that is
    # what the process holds from now on (on an H100 the allocated peak left it ~0.15 GiB over).
    peak = torch.cuda.max_memory_reserved(device)
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(0, total - free - torch.cuda.memory_reserved(device))
    non_torch += LAZY_KERNEL_HEADROOM_BYTES
    budget = kv_cache_budget_bytes(total, config.cache.gpu_memory_utilization, peak, non_torch)
    logger.info(
        "memory profile: peak %.2f GiB in PyTorch, %.2f GiB outside it (%d MiB of it kept for "
        "kernels loaded later); KV cache gets %.2f GiB (gpu_memory_utilization=%s of %.2f GiB)",
        peak / GiB,
        non_torch / GiB,
        LAZY_KERNEL_HEADROOM_BYTES >> 20,
        budget / GiB,
        config.cache.gpu_memory_utilization,
        total / GiB,
    )
    return budget


def check_kv_cache_holds_one_sequence(
    num_blocks: int, block_size: int, max_model_len: int, blocks_needed: int | None = None
) -> None:
    """Refuse to start when one sequence of `max_model_len` tokens cannot fit in the pool.

    `blocks_needed` is what such a sequence holds over every KV-cache group at once
    (`KVCacheLayout.blocks_per_request`); by default one block per `block_size` tokens.

    Such an engine would accept a request that can never be placed: the scheduler would
    preempt and re-admit it forever. As in vLLM, the fix is the user's choice (a bigger pool or
    a shorter `max_model_len`), so both numbers and every setting that moves them are named;
    `max_model_len` is never shrunk silently.
    """
    if blocks_needed is None:
        blocks_needed = -(-max_model_len // block_size)
    if num_blocks >= blocks_needed:
        return
    raise ValueError(
        f"the KV cache holds {num_blocks * block_size} tokens ({num_blocks} blocks of "
        f"{block_size}), less than one sequence of max_model_len={max_model_len} tokens needs "
        f"({blocks_needed} blocks over its KV-cache groups); give it at least "
        f"{blocks_needed} blocks (num_gpu_blocks, or more kv_cache_memory / "
        "gpu_memory_utilization) or lower max_model_len"
    )
