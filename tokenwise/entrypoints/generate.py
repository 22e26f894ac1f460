"""`tokenwise generate`: complete prompts, optionally streaming, and report throughput."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING

from tokenwise.entrypoints.engine_args import engine_kwargs
from tokenwise.outputs import RequestOutput
from tokenwise.sampling.params import SamplingParams

if TYPE_CHECKING:
    from tokenwise.entrypoints.llm import LLM


def _read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompts)
    if not prompts and not sys.stdin.isatty():
        prompts = [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        raise ValueError("no prompt given: pass PROMPT arguments or pipe prompts on stdin")
    return prompts


def run_generate(args: argparse.Namespace, params: SamplingParams) -> int:
    from tokenwise.entrypoints.llm import LLM

    prompts = _read_prompts(args)
    started = time.perf_counter()
    llm = LLM(args.model, **engine_kwargs(args))
    start = time.perf_counter()  # the engine is ready
    if args.stream:
        outputs, first_output = _generate_streaming(llm, prompts, params)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        first_output = time.perf_counter()
        for out in outputs:
            _print_completion(out)
    elapsed = time.perf_counter() - start
    print(
        f"[engine ready in {start - started:.2f} s; first output {first_output - start:.2f} s "
        "after that]",
        file=sys.stderr,
    )
    n_tokens = sum(len(c.token_ids) for out in outputs for c in out.outputs)
    print(
        f"[{len(prompts)} prompt(s), {n_tokens} tokens generated in {elapsed:.2f} s: "
        f"{n_tokens / max(elapsed, 1e-9):.1f} tokens/s]",
        file=sys.stderr,
    )
    return 0


def _print_completion(out: RequestOutput) -> None:
    for c in out.outputs:
        label = f" (sample {c.index})" if len(out.outputs) > 1 else ""
        print(f"--- prompt{label}: {out.prompt!r} [{c.finish_reason}]")
        print(f"{out.prompt}{c.text}")


def _generate_streaming(
    llm: LLM, prompts: list[str], params: SamplingParams
) -> tuple[list[RequestOutput], float]:
    """All prompts run batched; the first unfinished one streams live, later ones are buffered
    and shown in order once those before them finish. With n > 1 sample 0 is streamed.
    Returns the outputs and when the first generated text reached the terminal."""
    first_output = 0.0
    engine = llm.llm_engine
    ids = [f"cli-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    results: dict[str, RequestOutput] = {}
    shown, printed = 0, -1  # prompt being printed; characters of it printed (-1: header not yet)
    while shown < len(ids):
        for delta in engine.step():
            if delta.request_id in results:
                results[delta.request_id].merge(delta)
            else:
                results[delta.request_id] = delta
        while shown < len(ids):
            out = results.get(ids[shown])
            if printed < 0:
                sys.stdout.write(f"--- prompt: {prompts[shown]!r}\n{prompts[shown]}")
                printed = 0
            text = out.outputs[0].text if out is not None and out.outputs else ""
            sys.stdout.write(text[printed:])
            sys.stdout.flush()
            if text and not first_output:
                first_output = time.perf_counter()
            printed = len(text)
            if out is None or not out.finished:
                break
            for extra in out.outputs[1:]:
                sys.stdout.write(f"\n--- sample {extra.index}:\n{prompts[shown]}{extra.text}")
            sys.stdout.write("\n")
            shown, printed = shown + 1, -1
    return [results[rid] for rid in ids], first_output or time.perf_counter()
