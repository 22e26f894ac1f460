"""Throughput of a batch mixing 4 LoRA adapters vs the base model alone, in one run.

    python benchmarks/lora_bench.py [--num-prompts 32] [--input-len 128] [--output-len 64]

The model is the llama-100m shape with dummy weights; four rank-16 adapters on every linear
layer (q/k/v/o, gate/up/down) are written as PEFT directories with random weights (their values
do not change the cost). Three engines run the same requests, greedy with `ignore_eos`:
  base         LoRA off (the baseline)
  lora-base    LoRA on with 4 slots, every request on the base model (cost of the slots alone:
               base-model steps skip the adapter matmuls)
  lora-mix-4   LoRA on, requests spread round-robin over the 4 adapters (every step mixes them)
Figures are output tokens per second of wall time and the ratio to `base`, measured in the
same run on this machine; the CPU flags are printed with them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenwise import LLM, LoRARequest, SamplingParams  # noqa: E402

MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "llama-100m")
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(path: str, config: dict, rank: int, seed: int) -> None:
    """A PEFT directory with random A/B on every linear layer of the llama config."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inter, heads = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * heads, config["num_key_value_heads"] * heads
    shapes = {
        "self_attn.q_proj": (hidden, q),
        "self_attn.k_proj": (hidden, kv),
        "self_attn.v_proj": (hidden, kv),
        "self_attn.o_proj": (q, hidden),
        "mlp.gate_proj": (hidden, inter),
        "mlp.up_proj": (hidden, inter),
        "mlp.down_proj": (inter, hidden),
    }
    weights = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (fan_in, fan_out) in shapes.items():
            name = f"base_model.model.model.layers.{layer}.{module}"
            weights[f"{name}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.01
            weights[f"{name}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.01
    os.makedirs(path, exist_ok=True)
    save_file(weights, os.path.join(path, "adapter_model.safetensors"))
    peft_config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank}
    peft_config["target_modules"] = list(TARGETS)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(peft_config, f)


def run(name: str, prompts: list[list[int]], params: SamplingParams, loras: list, **kw) -> float:
    llm = LLM(
        MODEL,
        load_format="dummy",
        dtype="float32",
        skip_tokenizer_init=True,
        max_num_seqs=len(prompts),
        **kw,
    )
    llm.generate(prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return tokens / elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rank", type=int, default=16)
    args = p.parse_args()
    with open(os.path.join(MODEL, "config.json")) as f:
        config = json.load(f)
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, config["vocab_size"], (args.input_len,), generator=gen).tolist()
        for _ in range(args.num_prompts)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    lora_kw = {"enable_lora": True, "max_loras": 4, "max_lora_rank": args.rank}
    with tempfile.TemporaryDirectory() as tmp:
        adapters = []
        for i in range(4):
            path = os.path.join(tmp, f"adapter{i}")
            write_adapter(path, config, args.rank, seed=i)
            adapters.append(LoRARequest(f"adapter{i}", i + 1, path))
        mixed = [adapters[i % 4] for i in range(args.num_prompts)]
        results = {
            "base": run("base", prompts, params, None),
            "lora-base": run("lora-base", prompts, params, None, **lora_kw),
            "lora-mix-4": run("lora-mix-4", prompts, params, mixed, **lora_kw),
        }
    cpu = open("/proc/cpuinfo").read()
    flags = [f for f in ("avx2", "avx512f", "avx512_bf16") if f in cpu]
    print(
        f"CPU flags: {' '.join(flags)}; {torch.get_num_threads()} threads; llama-100m fp32, "
        f"{args.num_prompts} requests x {args.input_len} in / {args.output_len} out, "
        f"adapters of rank {args.rank} on every linear layer"
    )
    print("| engine | output tok/s | vs base |")
    print("|---|---|---|")
    for name, rate in results.items():
        print(f"| {name} | {rate:.1f} | {rate / results['base']:.2f}x |")


if __name__ == "__main__":
    main()
