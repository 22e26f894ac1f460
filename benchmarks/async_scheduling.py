"""Async scheduling off and on, with one stream and with 16, in one run (issue #51, item 3).

    python benchmarks/async_scheduling.py --config llama-100m [--dtype bfloat16] [--repeats 2]

Each mode is an engine built with its settings: `async_scheduling` off or on, and the
forward pass's torch threads (all cores, or all but one, leaving that one to the engine's
thread, which schedules and detokenizes while the pass runs). Random token-id prompts of
`--prompt-len` tokens, greedy, EOS ignored, `--max-tokens` out per stream; dummy weights from
benchmarks/configs (or the built-in model, `--config default`); the built-in model's
tokenizer, so that every step detokenizes, as a server does. The modes take turns, `--repeats` times, and the best time of
each is kept, so machine noise hits them alike. Prints out tok/s, the ratio to async off with
all cores, whether the greedy tokens equal that mode's, and the CPU flags.

Run it with `OMP_WAIT_POLICY=PASSIVE` on a machine other processes load: with the default
policy the OpenMP threads of a synchronous engine spin between forward passes, and where
the cores are oversubscribed that alone makes it several times slower (docs/scheduling.md).
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenwise import LLM, SamplingParams  # noqa: E402
from tokenwise.model_config import cpu_flag_summary  # noqa: E402

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
DEFAULT = os.path.join(os.path.dirname(CONFIGS), "..", "tokenwise", "models_data", "default")


@dataclass(frozen=True)
class Mode:
    name: str
    async_scheduling: bool
    threads: int


def modes(cores: int) -> list[Mode]:
    out = [Mode("off, all cores", False, cores), Mode("on, all cores", True, cores)]
    if cores > 1:
        out += [
            Mode("on, forward on all but one", True, cores - 1),
            Mode("off, forward on all but one", False, cores - 1),
        ]
    return out


def model_dir(config: str, workdir: str) -> tuple[str, str]:
    """The model folder and its load format: the built-in model as it is ("default"), or a
    config with the built-in model's tokenizer beside it (ids past its vocabulary decode to
    nothing, at the detokenizer's usual cost per token)."""
    if config == "default":
        return DEFAULT, "auto"
    path = os.path.join(workdir, config)
    shutil.copytree(os.path.join(CONFIGS, config), path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(DEFAULT, name), path)
    return path, "dummy"


def run_mode(
    path: str, load_format: str, mode: Mode, dtype: str, prompts: list[list[int]], max_tokens: int
) -> tuple[float, list[list[int]]]:
    """Seconds for one batch of `prompts` (after a warm-up) and its tokens."""
    torch.set_num_threads(mode.threads)
    llm = LLM(
        path,
        load_format=load_format,
        dtype=dtype,
        async_scheduling=mode.async_scheduling,
        max_model_len=1024,
        kv_cache_memory=256 << 20,
    )
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(batch, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    llm.llm_engine.shutdown()
    del llm
    gc.collect()
    return elapsed, [o.outputs[0].token_ids for o in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--config", default="llama-100m", help="a folder of benchmarks/configs, or default"
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--streams", default="1,16", help="comma list of concurrent streams")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    cores = torch.get_num_threads()
    gen = torch.Generator().manual_seed(0)
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        path, load_format = model_dir(args.config, workdir)
        for streams in (int(s) for s in args.streams.split(",")):
            prompts = [
                torch.randint(3, 4000, (args.prompt_len,), generator=gen).tolist()
                for _ in range(streams)
            ]
            best: dict[str, float] = {}
            tokens: dict[str, list[list[int]]] = {}
            for _ in range(args.repeats):
                for mode in modes(cores):
                    t, toks = run_mode(
                        path, load_format, mode, args.dtype, prompts, args.max_tokens
                    )
                    best[mode.name] = min(best.get(mode.name, float("inf")), t)
                    tokens[mode.name] = toks
            torch.set_num_threads(cores)
            base = modes(cores)[0].name
            for mode in modes(cores):
                tok_s = streams * args.max_tokens / best[mode.name]
                same = "equal" if tokens[mode.name] == tokens[base] else "differ"
                ratio = best[base] / best[mode.name]
                rows.append(f"| {streams} | {mode.name} | {tok_s:.1f} | {ratio:.2f}x | {same} |")
    print(
        f"{args.config} {args.dtype}, {args.prompt_len} in / {args.max_tokens} out per stream, "
        f"best of {args.repeats}, {cores} torch threads, OMP_WAIT_POLICY="
        f"{os.environ.get('OMP_WAIT_POLICY', 'unset')}; CPU flags: {cpu_flag_summary()}"
    )
    print("| streams | async scheduling | out tok/s | vs off, all cores | greedy tokens |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
