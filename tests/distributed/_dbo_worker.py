"""Rank body of test_dbo_dp.py: one MoE engine per DP rank, run without, with sequential and
with overlapped micro-batches (its own module so `spawn` can import it by name).

Each mode runs the same prompts greedily; the rank records the logits of every step (wrapping
the runner's `_logits`), the tokens, which steps were split, and the DBO event trace of every
overlapped step. Last, one DBO step fails inside micro-batch 1 on rank 1 only: rank 1's step
must raise that error, and rank 0, left waiting for a collective rank 1 never issues, must fail
within its (shortened) DBO timeout. Reports are plain Python values; logits are compared here,
on the rank, and only the differences travel.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from typing import Any

MAX_TOKENS = 3
# Prompt lengths per rank: similar totals (43 and 40 tokens), so that prefill and decode steps
# split (half the larger count stays below the smaller); rank 0's cut falls inside a request.
PROMPT_LENS = [(20, 9, 14), (17, 11, 12)]
# (enable_microbatching, TOKENWISE_DBO_SEQUENTIAL, TOKENWISE_MOE_DP_CHUNK_SIZE): the last mode
# exchanges 3 tokens per rank at a time, so the two micro-batches yield different numbers of
# times per layer (7 and 8 chunks in the prefill).
MODES = {
    "unsplit": (False, "0", ""),
    "sequential": (True, "1", ""),
    "dbo": (True, "0", ""),
    "dbo_chunked": (True, "0", "3"),
}


def prompts(rank: int, vocab: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(1000 + rank)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS[rank]]


def run_rank(rank: int, port: int, path: str, results: Any) -> None:
    try:
        results.put((rank, _run(rank, port, path)))
    except BaseException:
        results.put((rank, {"error": traceback.format_exc()}))
    # Leave at once: rank 0's gloo group may still hold the collective rank 1 abandoned, and
    # tearing it down would wait for gloo's own timeout.
    results.close()
    results.join_thread()
    os._exit(0)


def _run(rank: int, port: int, path: str) -> dict[str, Any]:
    import os

    import torch

    from tokenwise.distributed import get_dp_group, init_dp_group
    from tokenwise.distributed.dbo import dbo_current_ubatch
    from tokenwise.engine.llm_engine import LLMEngine
    from tokenwise.entrypoints.llm import build_engine_config
    from tokenwise.layers.fused_moe.layer import FusedMoE
    from tokenwise.sampling.params import SamplingParams

    torch.set_num_threads(1)
    config = build_engine_config(
        path,
        dtype="float32",
        data_parallel_size=2,
        enable_expert_parallel=True,
        enable_dbo=True,
        microbatching_token_threshold=2,
        enable_prefix_caching=False,
        num_gpu_blocks=32,
    )
    config.parallel.data_parallel_rank = rank
    init_dp_group(config.parallel, "127.0.0.1", port, 60.0, "cpu")
    engine = LLMEngine(config, "cpu")
    runner = engine.runner
    logits_of_step: list[torch.Tensor] = []
    logits = runner._logits

    def recording_logits(hidden: torch.Tensor, indices: list[int]) -> torch.Tensor:
        out = logits(hidden, indices)
        logits_of_step.append(out.clone())
        return out

    runner._logits = recording_logits
    split_steps: list[tuple[int, bool]] = []  # (tokens, all decode) of every split step
    run_ubatches = runner._run_ubatches

    def recording_run(step: Any, md: Any, counts: Any) -> Any:
        split_steps.append((step.num_tokens, bool((step.query_lens_np == 1).all())))
        return run_ubatches(step, md, counts)

    runner._run_ubatches = recording_run
    traces: list[Any] = []
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    my_prompts = prompts(rank, config.model.vocab_size)
    report: dict[str, Any] = {"prompts": my_prompts}
    logits_by_mode = {}
    for mode, (split, sequential, chunk) in MODES.items():
        config.parallel.enable_microbatching = split
        os.environ["TOKENWISE_DBO_SEQUENTIAL"] = sequential
        os.environ["TOKENWISE_MOE_DP_CHUNK_SIZE"] = chunk
        logits_of_step.clear()
        split_steps.clear()
        outputs: dict[str, list[int]] = {}  # steps return the tokens new since the last
        finished = 0
        for i, p in enumerate(my_prompts):
            engine.add_request(f"{mode}-{i}", p, params)
        for _ in range(50):  # collect each request's tokens as the engine finishes it
            for out in _step_all(engine, get_dp_group(), traces, runner):
                outputs.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
                finished += int(out.finished)
            if finished == len(my_prompts):
                break
        else:
            raise RuntimeError(f"{mode}: requests still unfinished after 50 steps")
        logits_by_mode[mode] = list(logits_of_step)
        report[mode] = {
            "tokens": [list(outputs[f"{mode}-{i}"]) for i in range(len(my_prompts))],
            "split_steps": list(split_steps),
        }
    os.environ["TOKENWISE_MOE_DP_CHUNK_SIZE"] = ""
    for mode in ("sequential", "dbo", "dbo_chunked"):
        pairs = zip(logits_by_mode[mode], logits_by_mode["unsplit"], strict=True)
        report[mode]["max_logit_diff"] = max((a - b).abs().max().item() for a, b in pairs)
    report["dbo_traces"] = traces

    # A failure inside micro-batch 1 of rank 1 must end both ranks' steps, not hang them.
    os.environ["TOKENWISE_DBO_TIMEOUT_S"] = "5"

    def failing(self: FusedMoE, hidden: torch.Tensor, router_logits: torch.Tensor) -> Any:
        if rank == 1 and dbo_current_ubatch() == 1:
            raise RuntimeError("injected expert failure")
        return FusedMoE.forward_local(self, hidden, router_logits)

    for module in runner.model.modules():
        if isinstance(module, FusedMoE):
            module.forward_local = failing.__get__(module)
    for i, p in enumerate(my_prompts):
        engine.add_request(f"fail-{i}", p, params)
    started = time.monotonic()
    try:
        engine.step()
        report["failure"] = None
    except Exception as exc:
        report["failure"] = {
            "type": type(exc).__name__,
            "message": str(exc),
            "notes": list(getattr(exc, "__notes__", [])),
            "seconds": time.monotonic() - started,
            "threads_left": [t.name for t in threading.enumerate() if "ubatch" in t.name],
        }
    return report


def _step_all(engine: Any, group: Any, traces: list[Any], runner: Any) -> list[Any]:
    """One lock-step iteration; keeps the DBO trace of a step that ran overlapped."""
    import torch
    import torch.distributed as dist

    local = engine.has_unfinished_requests()
    flags = torch.tensor([int(local)], dtype=torch.int32)
    dist.all_reduce(flags, group=group)
    if not int(flags[0]):
        return []
    runner.last_ubatch_trace = None
    outs = engine.step() if local else (engine.execute_dummy_batch() or [])
    if runner.last_ubatch_trace is not None:
        traces.append(runner.last_ubatch_trace)
    return outs
