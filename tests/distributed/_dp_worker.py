"""Entry point of the spawned DP ranks used by test_dp_coordination.py.

It lives in its own importable module because a spawned child re-imports the target function by
module name; a function defined inside a test could not be found there. Results travel back as
plain Python values (no tensors) so the parent can compare them with `==`.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

NO = (False, False)
# (name, per-rank kwargs for coordinate_batch_across_dp); rank r uses element r of each pair.
SCENARIOS: list[tuple[str, dict[str, tuple[Any, Any]]]] = [
    ("pad_both", {"unpadded": (5, 9), "allow_padding": (True, True), "mode": (2, 1)}),
    ("pad_one_forbids", {"unpadded": (5, 9), "allow_padding": (True, False), "mode": (1, 1)}),
    (
        "own_padded_sizes_no_dp_padding",
        {"unpadded": (5, 9), "padded": (8, 16), "allow_padding": (False, False)},
    ),
    ("own_padded_sizes_dp_padding", {"unpadded": (5, 9), "padded": (8, 16)}),
    # Nobody allows DP padding here: micro-batching must force it on.
    ("ubatch_both", {"unpadded": (20, 30), "allow_ubatch": (True, True), "allow_padding": NO}),
    (
        "ubatch_only_one_allows",
        {"unpadded": (20, 30), "allow_ubatch": (True, False), "allow_padding": NO},
    ),
    ("ubatch_one_below_threshold", {"unpadded": (10, 30), "allow_ubatch": (True, True)}),
    # Uniform decode, threshold 4: padded max 12 is split at 6, so rank 0 needs > 6 tokens.
    (
        "ubatch_second_half_empty",
        {"unpadded": (6, 12), "allow_ubatch": (True, True), "decode": (True, True)},
    ),
    (
        "ubatch_second_half_real",
        {"unpadded": (7, 12), "allow_ubatch": (True, True), "decode": (True, True)},
    ),
    ("graph_mode_enum", {"unpadded": (1, 1), "mode": ("FULL", "PIECEWISE")}),
    ("graph_mode_none_wins", {"unpadded": (1, 1), "mode": ("FULL", "NONE")}),
]

MOE_TOKENS = (3, 7)
DENSE_TOKENS = 11


def _counting(fn: Callable[..., Any], counter: list[int]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        counter[0] += 1
        return fn(*args, **kwargs)

    return wrapper


def _run_scenarios(rank: int, cfg: Any) -> dict[str, Any]:
    from tokenwise.config import CUDAGraphMode
    from tokenwise.distributed import coordinate_batch_across_dp

    out: dict[str, Any] = {}
    for name, spec in SCENARIOS:
        mode = spec.get("mode", (0, 0))[rank]
        should_ubatch, padded, synced = coordinate_batch_across_dp(
            num_tokens_unpadded=spec["unpadded"][rank],
            allow_microbatching=spec.get("allow_ubatch", (False, False))[rank],
            allow_dp_padding=spec.get("allow_padding", (True, True))[rank],
            parallel_config=cfg,
            num_tokens_padded=spec.get("padded", (None, None))[rank],
            uniform_decode=spec.get("decode", NO)[rank],
            cudagraph_mode=CUDAGraphMode[mode] if isinstance(mode, str) else mode,
        )
        assert padded is not None and padded.device.type == "cpu"
        out[name] = (should_ubatch, padded.tolist(), synced)
    return out


def run_rank(rank: int, port: int, second_port: int, queue: Any) -> None:
    """Run every scenario as DP rank `rank` and put `(rank, results)` (or an error) on `queue`."""
    try:
        queue.put((rank, _run_rank(rank, port, second_port)))
    except BaseException:
        queue.put((rank, {"error": traceback.format_exc()}))


def _run_rank(rank: int, port: int, second_port: int) -> dict[str, Any]:
    from datetime import timedelta

    import torch.distributed as dist

    from tokenwise.config import EngineConfig, ParallelConfig
    from tokenwise.distributed import destroy_dp_group, init_dp_group, is_dp_group_initialized
    from tokenwise.forward_context import set_forward_context

    calls = [0]  # every all_reduce this process issues, to prove dense steps issue none
    dist.all_reduce = _counting(dist.all_reduce, calls)

    cfg = ParallelConfig(
        data_parallel_size=2,
        data_parallel_rank=rank,
        is_moe_model=True,
        enable_microbatching=True,
        microbatching_decode_token_threshold=4,
        microbatching_prefill_token_threshold=16,
    )
    init_dp_group(cfg, master_port=port, timeout_s=30)
    init_dp_group(cfg, master_port=port, timeout_s=30)  # second call: a no-op
    out: dict[str, Any] = {}
    try:
        init_dp_group(ParallelConfig(data_parallel_size=2, data_parallel_rank=1 - rank))
        out["reinit_error"] = None
    except RuntimeError as exc:
        out["reinit_error"] = str(exc)

    out["scenarios"] = _run_scenarios(rank, cfg)
    out["calls_after_scenarios"] = calls[0]

    with set_forward_context(None, EngineConfig(parallel=cfg), num_tokens=MOE_TOKENS[rank]) as ctx:
        md = ctx.dp_metadata
        assert md is not None
        out["moe"] = (md.num_tokens_across_dp_cpu.tolist(), int(md.max_tokens_across_dp_cpu))
    out["calls_after_moe"] = calls[0]

    if rank == 0:
        # Only one rank enters: a collective here would pair with nothing (or with the wrong
        # call on the other rank), so the call count below is the real check.
        dense = EngineConfig(
            parallel=ParallelConfig(data_parallel_size=2, data_parallel_rank=0, is_moe_model=False)
        )
        with set_forward_context(None, dense, num_tokens=DENSE_TOKENS) as ctx:
            out["dense_dp_metadata"] = ctx.dp_metadata
        out["calls_after_dense"] = calls[0]

    destroy_dp_group()
    out["destroyed"] = not is_dp_group_initialized() and not dist.is_initialized()

    # Second path: torch.distributed already initialised by someone else -> new_group.
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{second_port}",
        world_size=2,
        rank=rank,
        timeout=timedelta(seconds=30),
    )
    try:
        init_dp_group(cfg, timeout_s=30)
        out["subgroup_scenario"] = _run_scenarios(rank, cfg)["pad_both"]
        destroy_dp_group()
        out["default_group_kept"] = dist.is_initialized()
    finally:
        dist.destroy_process_group()
    return out
