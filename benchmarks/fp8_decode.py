"""FP8 weights on CPU end to end: batch-1 decode and prefill against the bf16 model.

    python benchmarks/fp8_decode.py [--config llama-100m] [--repeats 3]

Three engines of one config (dummy weights, bf16 activations): "bf16" (no quantization),
"fp8" (`quantization="fp8"`, fp8 bytes kept: the `native.fp8_gemv` kernel at decode, the weight
dequantized per call for prefill) and "fp8-dense" (`TOKENWISE_CPU_FP8_WEIGHTS=dense`: the fp8
values dequantized to bf16 once at load). Times a 256-token prompt (prefill, max_tokens=1) and
128 greedy tokens after it (decode tok/s, prefill time subtracted), engines taking turns, best
of `--repeats`; prints the linear layers' weight MiB of each.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenwise import LLM, SamplingParams  # noqa: E402
from tokenwise.model_config import cpu_flag_summary  # noqa: E402

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
ENGINES = {"bf16": (None, "auto"), "fp8": ("fp8", "fp8"), "fp8-dense": ("fp8", "dense")}


def linear_mib(llm: LLM) -> float:
    """MiB of the decoder layers' linear weights as held (fp8 records or dense weights)."""
    total = 0
    for module in llm.llm_engine.runner.model.model.layers.modules():
        held = getattr(module, "quant_weight", None)
        if held is not None:
            total += held.nbytes
        elif hasattr(module, "quant_weight") and not module.weight.is_meta:
            total += module.weight.numel() * module.weight.element_size()
    return total / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="llama-100m", help="a folder of benchmarks/configs")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    llms = {}
    for name, (quantization, weights) in ENGINES.items():
        os.environ["TOKENWISE_CPU_FP8_WEIGHTS"] = weights
        llms[name] = LLM(
            os.path.join(CONFIGS, args.config),
            load_format="dummy",
            dtype="bfloat16",
            skip_tokenizer_init=True,
            quantization=quantization,
            enable_prefix_caching=False,  # every repeat prefills the prompt again
        )
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 4000, (256,), generator=gen).tolist()
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    decode = SamplingParams(temperature=0, max_tokens=129, ignore_eos=True)
    for llm in llms.values():
        llm.generate([prompt], decode, use_tqdm=False)  # warm-up: kernels built, caches touched
    prefill_s = dict.fromkeys(llms, float("inf"))
    total_s = dict.fromkeys(llms, float("inf"))
    for _ in range(args.repeats):
        for name, llm in llms.items():
            start = time.perf_counter()
            llm.generate([prompt], first, use_tqdm=False)
            prefill_s[name] = min(prefill_s[name], time.perf_counter() - start)
            start = time.perf_counter()
            llm.generate([prompt], decode, use_tqdm=False)
            total_s[name] = min(total_s[name], time.perf_counter() - start)
    print(
        f"{args.config}, bf16, batch 1, 256 in / 128 out, best of {args.repeats}, "
        f"{torch.get_num_threads()} threads; CPU flags: {cpu_flag_summary()}"
    )
    print("| engine | linear weights MiB | prefill ms | decode tok/s | vs bf16 decode |")
    print("|---|---|---|---|---|")
    base = 128 / (total_s["bf16"] - prefill_s["bf16"])
    for name, llm in llms.items():
        tok_s = 128 / (total_s[name] - prefill_s[name])
        print(
            f"| {name} | {linear_mib(llm):.1f} | {prefill_s[name] * 1e3:.1f} | {tok_s:.1f} | "
            f"{tok_s / base:.2f}x |"
        )


if __name__ == "__main__":
    main()
