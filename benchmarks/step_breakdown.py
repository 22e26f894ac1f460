"""Where one decode step's time goes, part by part of `LLMEngine.step`.

    python benchmarks/step_breakdown.py --config llama-100m --dtype bfloat16 [--ops 25] [-q int4]
        [--enforce-eager] [--batch 48]

One stream, or `--batch` streams decoded together (256-token prompts, 128 greedy tokens, dummy
weights, EOS ignored). Each part of the step (scheduler, input preparation, attention metadata,
the model's forward, logits, sampling metadata, sampler, detokenization, the scheduler's
update) is timed by wrapping the method that does it, and the median per decode step is printed
next to the step's own median: what is left is the rest of `step()` (outputs, statistics). The
prefill steps are left out. Inside the forward, the linear layers' paths (the small-M kernels,
oneDNN's prepacked linear, quantized weights dequantized for torch's matmul) and the attention
kernel are timed too. With `--ops N` the decode steps then run once more under `torch.profiler`
and the N ops with the most self CPU time per decode step are printed, with their call counts
per step: that is where the forward's time goes below the linear layers.

Timers cost ~1 µs each; the figures are for attribution, not for comparing revisions (for that,
`benchmarks/batch1_decode.py` interleaves its variants in one run).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenwise import LLM, SamplingParams  # noqa: E402
from tokenwise.layers import cpu_prepack  # noqa: E402
from tokenwise.layers.quantization import weight_only  # noqa: E402
from tokenwise.model_config import cpu_flag_summary  # noqa: E402
from tokenwise.native import gemv as cpu_gemv  # noqa: E402
from tokenwise.native import paged_decode as cpu_paged_decode  # noqa: E402
from tokenwise.native import qgemv as cpu_qgemv  # noqa: E402
from tokenwise.runner import sample_step  # noqa: E402

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
OUTPUT_LEN = 128


class Timers:
    """Wall time of wrapped callables, collected per engine step."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []
        self.active: set[str] = set()

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            self.active.add(name)
            try:
                return fn(*args, **kwargs)
            finally:
                self.active.discard(name)
                self.current[name] += time.perf_counter() - start

        return timed

    def end_step(self) -> None:
        self.steps.append(dict(self.current))
        self.current.clear()


def instrument(llm: LLM, timers: Timers) -> None:
    """Wrap the parts of one engine step (instance attributes, so nothing else is touched)."""
    engine = llm.llm_engine
    runner, scheduler = engine.runner, engine.scheduler
    engine_step = engine.step

    def step() -> Any:
        out = timers.wrap("step", engine_step)()
        timers.end_step()
        return out

    engine.step = step
    # The engine passes this method to the scheduler, which calls it per token.
    outputs = engine.output_processor
    outputs.detokenize_token = timers.wrap("detokenize", outputs.detokenize_token)
    scheduler.schedule = timers.wrap("schedule", scheduler.schedule)
    scheduler.update_from_output = timers.wrap("update_from_output", scheduler.update_from_output)
    runner.execute_model = timers.wrap("execute_model", runner.execute_model)
    runner.input_batch.prepare = timers.wrap("prepare inputs", runner.input_batch.prepare)
    runner.step_metadata.build = timers.wrap("attn metadata", runner.step_metadata.build)
    runner._run_eager = timers.wrap("model forward", runner._run_eager)
    if runner.graph_runner is not None:  # CPU graphs: a replay is the whole forward
        runner.graph_runner.execute = timers.wrap("model forward", runner.graph_runner.execute)
    runner._logits = timers.wrap("logits (lm_head)", runner._logits)
    for name in ("forward", "greedy"):  # `greedy`: the plain-greedy fast path, where it exists
        if hasattr(runner.sampler, name):
            setattr(runner.sampler, name, timers.wrap("sampler", getattr(runner.sampler, name)))
    # Inside the forward: the small-M linear kernel and the decode-attention kernel (with their
    # Python wrappers), looked up as module attributes by their callers.
    linear = cpu_gemv.linear
    in_forward = timers.wrap("  linear kernels", linear)

    def any_linear(*args: Any, **kwargs: Any) -> Any:  # the LM head's is in "logits" alone
        return (in_forward if "model forward" in timers.active else linear)(*args, **kwargs)

    cpu_gemv.linear = any_linear
    cpu_paged_decode.paged_decode = timers.wrap("  attention kernel", cpu_paged_decode.paged_decode)
    if hasattr(cpu_paged_decode, "decode_step"):  # the one-call decode step, where it exists
        cpu_paged_decode.decode_step = timers.wrap(
            "  attention kernel", cpu_paged_decode.decode_step
        )
    qgemv = cpu_qgemv.qgemv
    q_in_forward = timers.wrap("  quantized linear kernels", qgemv)

    def any_qgemv(*args: Any, **kwargs: Any) -> Any:
        return (q_in_forward if "model forward" in timers.active else qgemv)(*args, **kwargs)

    cpu_qgemv.qgemv = any_qgemv
    # Rows above the small-M kernels' limits: oneDNN's prepacked linear, and quantized layers'
    # dense weights rebuilt for torch's matmul.
    cpu_prepack._packed_linear = timers.wrap("  oneDNN linear", cpu_prepack._packed_linear)
    weight_only.QuantizedWeight._stored_dense = timers.wrap(
        "  dequantize", weight_only.QuantizedWeight._stored_dense
    )
    md_cls = sample_step.SamplingMetadata
    from_params = md_cls.from_params
    sample_step.SamplingMetadata = type(  # type: ignore[misc]
        "TimedSamplingMetadata",
        (md_cls,),
        {"from_params": staticmethod(timers.wrap("sampling metadata", from_params))},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="llama-100m", help="a folder of benchmarks/configs")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--ops", type=int, default=0, help="also list the top N ops per step")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: as is)")
    parser.add_argument("--quantization", "-q", default=None, help="e.g. int8, int4 (CPU)")
    parser.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no CPU graphs: the forward's kernels are timed one by one (a replay runs them in C)",
    )
    args = parser.parse_args()
    if args.batch < 1:
        parser.error(f"--batch must be at least 1, got {args.batch}")
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(
        os.path.join(CONFIGS, args.config),
        load_format="dummy",
        dtype=args.dtype,
        skip_tokenizer_init=True,
        quantization=args.quantization,
        enforce_eager=True if args.enforce_eager else None,
    )
    generator = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, 4000, (256,), generator=generator).tolist() for _ in range(args.batch)
    ]
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up: kernels built, caches touched
    timers = Timers()
    instrument(llm, timers)
    llm.generate(prompts, params, use_tqdm=False)
    # No prefill step (with --batch, the few prefill steps fall outside the median).
    decode = [s for s in timers.steps if "execute_model" in s][1:]
    step_ms = statistics.median(s["step"] for s in decode) * 1e3
    print(
        f"{args.config} {args.dtype}, batch {args.batch}, {torch.get_num_threads()} threads; "
        f"CPU flags: {cpu_flag_summary()}"
    )
    print(f"{len(decode)} decode steps; median per step (ms):")
    print("| part | ms | share |")
    print("|---|---|---|")
    # Every part any decode step timed (with --batch, the first steps may still be prefill).
    names = list(dict.fromkeys(n for s in decode for n in s if n not in ("step", "execute_model")))
    parts = {n: statistics.median(s.get(n, 0.0) for s in decode) * 1e3 for n in names}
    parts["execute_model, rest"] = statistics.median(
        s["execute_model"] for s in decode
    ) * 1e3 - sum(parts[n] for n in names if n in _RUNNER_PARTS)
    inner = ("  linear kernels", "  quantized linear kernels", "  attention kernel")
    inner += ("  oneDNN linear", "  dequantize")
    parts["  forward, rest"] = parts["model forward"] - sum(parts.get(n, 0.0) for n in inner)
    parts["step, rest"] = step_ms - sum(ms for n, ms in parts.items() if not n.startswith(" "))
    for name, ms in parts.items():
        print(f"| {name} | {ms:.3f} | {100 * ms / step_ms:.1f}% |")
    print(f"| **step** | {step_ms:.3f} | 100% |")
    if args.ops:
        print_ops(llm, prompts, params, args.ops)


_RUNNER_PARTS = {
    "prepare inputs",
    "attn metadata",
    "model forward",
    "logits (lm_head)",
    "sampling metadata",
    "sampler",
}


def print_ops(llm: LLM, prompts: list[list[int]], params: SamplingParams, top: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
    steps = OUTPUT_LEN  # one prefill step included: the per-step figures are a little high
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) / steps / 1e3
    print(f"\nprofiled: {total:.2f} ms self CPU per step (profiler overhead included)")
    print("| op | calls/step | self ms/step | total ms/step |")
    print("|---|---|---|---|")
    for e in events[:top]:
        print(
            f"| {e.key} | {e.count / steps:.1f} | {e.self_cpu_time_total / steps / 1e3:.3f} | "
            f"{e.cpu_time_total / steps / 1e3:.3f} |"
        )


if __name__ == "__main__":
    main()
