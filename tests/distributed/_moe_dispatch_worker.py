"""Rank body for test_moe_dispatch (its own module so `spawn` can import it by name)."""

from __future__ import annotations

import traceback
from typing import Any

import torch

HIDDEN, EXPERTS = 8, 4
# (tokens of rank 0, tokens of rank 1, chunk size)
CASES = [(3, 5, 256), (1, 17, 4), (9, 2, 3), (6, 6, 6)]


def _weights(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(HIDDEN, HIDDEN, generator=g), torch.randn(EXPERTS, HIDDEN, generator=g)


def expected_output(hidden: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """What the two ranks' partial contributions sum to, computed on one rank."""
    out = torch.zeros_like(hidden)
    for rank in range(2):
        w, v = _weights(rank)
        out += hidden @ w + logits @ v
    return out


def run_rank(rank: int, port: int, results: Any) -> None:
    from tokenwise.config import ParallelConfig
    from tokenwise.distributed import destroy_dp_group, init_dp_group
    from tokenwise.distributed.moe_dispatch import naive_dispatch_combine
    from tokenwise.forward_context import DPMetadata

    try:
        parallel = ParallelConfig(data_parallel_size=2, data_parallel_rank=rank)
        init_dp_group(parallel, master_port=port, timeout_s=30)
        w, v = _weights(rank)
        report = {}
        for n0, n1, chunk in CASES:
            g = torch.Generator().manual_seed(n0 * 100 + n1)
            hidden = torch.randn(n0 + n1, HIDDEN, generator=g)
            logits = torch.randn(n0 + n1, EXPERTS, generator=g)
            mine = slice(0, n0) if rank == 0 else slice(n0, n0 + n1)
            seen: list[int] = []

            def local_experts(
                h: torch.Tensor, lg: torch.Tensor, seen: list[int] = seen
            ) -> torch.Tensor:
                seen.append(h.shape[0])
                return h @ w + lg @ v

            md = DPMetadata.make(parallel, n0 if rank == 0 else n1, torch.tensor([n0, n1]))
            out = naive_dispatch_combine(
                hidden[mine], logits[mine], local_experts, md, parallel, chunk_size=chunk
            )
            err = (out - expected_output(hidden, logits)[mine]).abs().max().item()
            report[(n0, n1, chunk)] = {"err": err, "gathered_rows": seen}
        destroy_dp_group()
        results.put((rank, report))
    except BaseException:
        results.put((rank, {"error": traceback.format_exc()}))
