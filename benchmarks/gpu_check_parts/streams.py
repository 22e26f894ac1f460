"""Parts about overlap: dual-batch overlap across two GPUs, and async scheduling.

DBO needs two data-parallel ranks with an expert-parallel MoE between them, one GPU each; on a
machine with fewer CUDA devices (every dry run) the part says so instead of faking a figure.
Its CPU form is benchmarks/dbo_overlap.py (two gloo processes, tests/distributed/test_dbo_dp.py);
a CUDA form (NCCL, one stream per micro-batch) is not written yet, so with two GPUs the part
still skips, naming that. Async scheduling (schedule step N+1 while step N runs, vLLM's
--async-scheduling) times the same greedy streams with it off and on. With it on, the sampled
ids come back by a non-blocking copy into pinned memory and an event
(`tokenwise/runner/deferred_tokens.py`): the next step's input is fed on the device, so its
launch is not behind the copy; the part reports how many steps took that path (a figure is
not ok when none did). A dry run has no CUDA event: the runner's path is the same with a
stand-in event whose copy lands only when the engine's thread asks for it (`_LateEvent`), so
every step reads its predecessor's token from the device-side patch.
"""

from __future__ import annotations

from typing import Any

from benchmarks.gpu_check_parts.plan import Context, Part, Skip


class _LateEvent:
    """A dry run's CUDA event: the copy "lands" once a thread other than the forward worker
    (the engine's, applying the step) asks; the worker's own checks see it in flight."""

    def __init__(self) -> None:
        self.done = False

    def record(self) -> None:
        pass

    def query(self) -> bool:
        import threading

        self.done = self.done or not threading.current_thread().name.startswith("tokenwise-forward")
        return self.done


class _CopiedEvent:
    """A dry run's event after a step's input copies: on CPU they are done when queued."""

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return True


def _count_deferred_steps(llm: Any, device: str) -> list[int]:
    """Count the steps whose ids come back by the non-blocking copy (one entry per step);
    on CPU (a dry run) the runner first gets the path with `_LateEvent`."""
    from tokenwise.runner.deferred_tokens import DeferredTokens

    runner = llm.llm_engine.runner
    if device != "cuda":
        runner.deferred = DeferredTokens(_LateEvent, runner.input_batch, _CopiedEvent)
    deferred = runner.deferred
    steps: list[int] = []
    if deferred is None:
        return steps
    launch = deferred.launch

    def counted(ids: Any, states: list) -> Any:
        steps.append(len(states))
        return launch(ids, states)

    deferred.launch = counted
    return steps


def dbo(ctx: Context) -> None:
    import torch

    count = torch.cuda.device_count() if ctx.device == "cuda" else 0
    if count < 2:
        raise Skip(f"DBO under DP=2 needs two CUDA devices; this machine has {count}")
    raise Skip(
        "DBO has no GPU benchmark yet: benchmarks/dbo_overlap.py runs its two ranks on CPU "
        "over gloo (a CUDA form, NCCL and one stream per micro-batch, is still to write)"
    )


def async_scheduling(ctx: Context) -> None:
    """Async scheduling off, then on: the same greedy streams on the workload model, one engine
    each, eager (the default mode elsewhere); ok when the tokens are equal."""
    import time

    import torch

    from benchmarks.gpu_check_parts.engine_parts import release, workload_model
    from tokenwise import LLM, SamplingParams

    model, _ = workload_model(ctx)
    streams, out_len = ctx.size((4, 8), (64, 256))
    gen = torch.Generator().manual_seed(ctx.seed)
    prompts = [
        {"prompt_token_ids": torch.randint(3, 200, (32,), generator=gen).tolist()}
        for _ in range(streams)
    ]
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    extra = ctx.size({"dtype": "float32"}, {"load_format": "dummy", "dtype": "bfloat16"})
    seconds: dict[bool, float] = {}
    tokens: dict[bool, list[list[int]]] = {}
    deferred_steps: list[int] = []
    for on in (False, True):
        llm = LLM(model, device=ctx.device, skip_tokenizer_init=True, async_scheduling=on,
                  max_model_len=ctx.size(512, 2048), **extra)  # fmt: skip
        llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        if on:
            deferred_steps = _count_deferred_steps(llm, ctx.device)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds[on] = time.perf_counter() - start
        tokens[on] = [o.outputs[0].token_ids for o in outs]
        llm.llm_engine.shutdown()
        del llm
        release()
    for on in (False, True):
        ok = tokens[on] == tokens[False] and (not on or len(deferred_steps) > 0)
        ctx.figure(f"async_{'on' if on else 'off'}_output_tokens_per_s",
                   round(streams * out_len / seconds[on], 1), "tok/s", ok,
                   streams=streams, output_len=out_len,
                   **({"non_blocking_copy_steps": len(deferred_steps)} if on else {}))  # fmt: skip


PARTS = [
    Part("dbo", 5, dbo, "dual-batch overlap streams under DP=2"),
    Part("async_scheduling", 90, async_scheduling, "greedy streams with async scheduling off/on"),
]
