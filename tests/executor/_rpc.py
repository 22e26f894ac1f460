"""Functions `collective_rpc` sends to workers (module-level: a spawned rank imports them)."""

from __future__ import annotations

import os
import time
from typing import Any

from tokenwise.distributed.tp_state import get_tp_rank


def describe_rank(worker: Any, tag: str) -> dict[str, Any]:
    """What one rank holds: its TP rank, process, and the rows of its qkv projection shard."""
    qkv = worker.runner.model.model.layers[0].self_attn.qkv_proj
    return {
        "tag": tag,
        "tp_rank": get_tp_rank(),
        "pid": os.getpid(),
        "qkv_rows": int(sum(qkv.output_sizes)),
        "num_blocks": worker.num_blocks,
    }


def fail_on_rank_1(worker: Any) -> int:
    if get_tp_rank() == 1:
        raise ValueError("rank 1 refuses")
    return get_tp_rank()


def sleep_on_rank_1(worker: Any, seconds: float) -> int:
    if get_tp_rank() == 1:
        time.sleep(seconds)
    return get_tp_rank()
