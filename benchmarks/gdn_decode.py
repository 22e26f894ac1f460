"""Gated DeltaNet decode on CPU: the C kernel's state bandwidth, and one-stream decode of a
~0.8B Qwen3.5-shaped hybrid against a dense Qwen3 of the same size.

    python benchmarks/gdn_decode.py [--tokens 64] [--prompt 32 512] [--repeats 3]
        [--dtype float32|bfloat16]

1. The decode kernel (`tokenwise.native.gdn_decode`) at batch 1 on one layer of the
   `configs/qwen3.5-0.8b` shape (16 value heads of 128 x 128, 1 MiB of float32 state),
   cycling over 64 slots so that every call's state comes from memory, not the cache: bytes
   of state read plus written per second (float32 and bf16 states), beside a plain `torch`
   copy of 256 MiB (read + written per second) as the machine's bandwidth, and the torch form
   of the same step; then one whole layer's step between its projections, fused (one C call)
   and op by op as before it, in float32 and bf16.
2. One stream, `--dtype`, dummy weights, EOS ignored: decode tokens/s of
   `configs/qwen3.5-0.8b` (18 Gated DeltaNet + 6 gated attention layers), replaying its CPU
   graph (the default) and eagerly (`enforce_eager`), and of its dense twin
   `configs/qwen3-0.8b-dense` (a `Qwen3ForCausalLM` with the same hidden size, MLP, vocabulary
   and layer count, every layer full attention: 16 heads of 128, 8 KV heads), for each prompt
   length: the engine's steps after the prefill are timed, `--tokens` of them, best of
   `--repeats` after a warm-up, the runs taking turns.

Prints the CPU flags. Not a timed test: numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenwise import LLM, SamplingParams  # noqa: E402
from tokenwise.attention.recurrent import RecurrentMetadata  # noqa: E402
from tokenwise.model_config import cpu_flag_summary  # noqa: E402
from tokenwise.models import gated_deltanet  # noqa: E402
from tokenwise.models.gated_delta_rule import delta_rule_step, l2_normalize  # noqa: E402
from tokenwise.native import gdn_decode  # noqa: E402

HYBRID = Path(__file__).parent / "configs" / "qwen3.5-0.8b"
DENSE = Path(__file__).parent / "configs" / "qwen3-0.8b-dense"  # vs_llamacpp.py's twin too


def _best(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def kernel_bandwidth(repeats: int) -> None:
    heads, dk, dv, slots = 16, 128, 128, 64
    numel = heads * dk * dv
    states = torch.randn(slots, numel) * 0.01
    q = l2_normalize(torch.randn(1, heads, dk)) * dk**-0.5
    k = l2_normalize(torch.randn(1, heads, dk))
    v, g, beta = torch.randn(1, heads, dv), -torch.rand(1, heads) * 0.1, torch.rand(1, heads)
    slot_ids = [torch.tensor([s]) for s in range(slots)]
    calls = 256
    if gdn_decode.load() is None:
        print("kernel: not built here (no C compiler)")
    else:

        def run_kernel() -> None:
            for i in range(calls):
                gdn_decode.gated_delta_decode(states, 0, slot_ids[i % slots], q, k, v, g, beta)

        run_kernel()
        threads = torch.get_num_threads()
        for n in sorted({1, threads}):
            torch.set_num_threads(n)
            t = _best(run_kernel, repeats) / calls
            print(
                f"kernel, batch 1, {heads}x{dk}x{dv} fp32 state ({numel * 4 / 2**20:.0f} MiB), "
                f"{n} thread(s): {t * 1e6:.0f} us/token/layer, "
                f"{2 * numel * 4 / t / 1e9:.1f} GB/s of state"
            )
        torch.set_num_threads(threads)
        halves = states.to(torch.bfloat16)

        def run_bf16() -> None:
            for i in range(calls):
                gdn_decode.gated_delta_decode(halves, 0, slot_ids[i % slots], q, k, v, g, beta)

        run_bf16()
        t = _best(run_bf16, repeats) / calls
        print(
            f"kernel, batch 1, bf16 state ({numel * 2 / 2**20:.1f} MiB), {threads} thread(s): "
            f"{t * 1e6:.0f} us/token/layer, {2 * numel * 2 / t / 1e9:.1f} GB/s of state"
        )

    def run_torch() -> None:
        for i in range(calls // 8):
            s = slot_ids[i % slots]
            state = states[s].view(1, heads, dk, dv)
            _, new = delta_rule_step(state, q, k, v, g, beta)
            states[s] = new.reshape(1, numel)

    t_torch = _best(run_torch, repeats) / (calls // 8)
    print(
        f"torch step (gather, 8 ops, scatter): {t_torch * 1e6:.0f} us/token/layer, "
        f"{2 * numel * 4 / t_torch / 1e9:.1f} GB/s of state"
    )
    big = torch.randn(64 * 2**20)
    dst = torch.empty_like(big)
    t_copy = _best(lambda: dst.copy_(big), repeats)
    print(
        f"machine: torch copy of 256 MiB, {2 * big.numel() * 4 / t_copy / 1e9:.1f} GB/s "
        f"(read + written), {torch.get_num_threads()} threads"
    )


class _LayerConfig(dict):
    """What a lone `GatedDeltaNet` reads of an engine config: the hybrid's dims."""

    def __init__(self) -> None:
        super().__init__()
        cfg = json.loads((HYBRID / "config.json").read_text())
        self.model = SimpleNamespace(hf_config=SimpleNamespace(**cfg))


def layer_step(repeats: int) -> None:
    """One Gated DeltaNet layer of the hybrid, the part between its two projections at batch
    1 (64 slots in turn, so states come from memory): the fused step against op by op (as
    before it), in float32 and bf16."""
    for dtype in (torch.float32, torch.bfloat16):
        best = _layer_times(dtype, repeats)
        print(
            f"one layer between its projections, {dtype}: fused {best['fused'] * 1e6:.0f} us, "
            f"op by op {best['op by op'] * 1e6:.0f} us, {torch.get_num_threads()} thread(s), "
            f"load average {os.getloadavg()[0]:.1f}",
            flush=True,
        )


def _layer_times(dtype: torch.dtype, repeats: int) -> dict[str, float]:
    layer = gated_deltanet.GatedDeltaNet(_LayerConfig(), f"layer.{dtype}")  # type: ignore[arg-type]
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape) * 0.02)
    layer = layer.to(dtype)
    states = (torch.randn(64, layer.state_numel) * 0.01).to(dtype)
    proj = layer.in_proj(torch.randn(1, layer.in_proj.weight.shape[1]).to(dtype))
    sizes = [layer.channels, layer.nv * layer.dv, layer.nv, layer.nv]

    def fused(i: int) -> None:
        layer._decode_step(proj, states, RecurrentMetadata([i % 64], [0, 1], [False]))

    def before(i: int) -> None:
        mixed, z, b, a = proj.split(sizes, dim=-1)
        beta = torch.sigmoid(b).float()
        g = -layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias.float())
        core = torch.empty(1, layer.nv, layer.dv)
        md = RecurrentMetadata([i % 64], [0, 1], [False])
        with op_by_op(True):
            layer._decode(mixed, g, beta, states, md, [0], core)
        layer.norm(core.to(dtype), z.reshape(1, layer.nv, layer.dv))

    best: dict[str, float] = {}
    for name, fn in (("fused", fused), ("op by op", before)) * (repeats + 1):
        start = time.perf_counter()
        for i in range(64):
            fn(i)
        best[name] = min(best.get(name, float("inf")), (time.perf_counter() - start) / 64)
    return best


def make_engine(path: Path, longest: int, tokens: int, dtype: str, eager: bool = False) -> LLM:
    return LLM(
        str(path),
        load_format="dummy",
        dtype=dtype,
        skip_tokenizer_init=True,
        max_model_len=longest + tokens + 16,
        num_gpu_blocks=(longest + tokens) // 16 + 8,
        max_num_seqs=1,
        enforce_eager=eager,
    )


@contextlib.contextmanager
def op_by_op(on: bool) -> Iterator[None]:
    """The Gated DeltaNet decode step as it ran before its fused kernel: op by op, the delta
    rule in the C kernel over float32 states only (bf16 states took the torch step)."""
    if not on:
        yield
        return
    saved = gated_deltanet.gated_delta_decode_step, gated_deltanet.gated_delta_decode

    def fp32_only(states: torch.Tensor, *args: Any) -> torch.Tensor | None:
        return saved[1](states, *args) if states.dtype == torch.float32 else None

    gated_deltanet.gated_delta_decode_step = lambda *args: False
    gated_deltanet.gated_delta_decode = fp32_only
    try:
        yield
    finally:
        gated_deltanet.gated_delta_decode_step, gated_deltanet.gated_delta_decode = saved


def decode_seconds(llm: LLM, rid: str, prompt: list[int], tokens: int) -> float:
    """Seconds per decode step of one stream after `prompt`: the engine stepped by hand,
    timing only the steps after the prefill."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=tokens + 1, ignore_eos=True)
    engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    req = engine.groups[rid][0]
    while not req.output_token_ids:  # the prefill (and its first token)
        engine.step()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return (time.perf_counter() - start) / (len(req.output_token_ids) - 1)


def compare(prompts: list[int], tokens: int, repeats: int, dtype: str) -> None:
    """The hybrid (replaying its CPU graph, then eagerly) and its dense twin (graphs), engines
    alive and taking turns (so that machine noise hits them alike); best of `repeats` after a
    warm-up, per prompt length."""
    runs = {
        "hybrid": make_engine(HYBRID, max(prompts), tokens, dtype),
        "hybrid eager": make_engine(HYBRID, max(prompts), tokens, dtype, eager=True),
        "dense": make_engine(DENSE, max(prompts), tokens, dtype),
    }
    gen = torch.Generator().manual_seed(0)
    for length in prompts:
        prompt = torch.randint(3, 30000, (length,), generator=gen).tolist()
        best = dict.fromkeys(runs, float("inf"))
        for attempt in range(repeats + 1):  # the first one warms up
            for name, llm in runs.items():
                t = decode_seconds(llm, f"{name}-{length}-{attempt}", prompt, tokens)
                best[name] = min(best[name], t) if attempt else best[name]
        tps = {name: 1.0 / t for name, t in best.items()}
        print(
            f"prompt {length:5d}, {dtype}: hybrid {tps['hybrid']:6.2f} tok/s (eager: "
            f"{tps['hybrid eager']:6.2f}), dense Qwen3 twin {tps['dense']:6.2f} tok/s, "
            f"hybrid/dense {tps['hybrid'] / tps['dense']:.2f}x (eager "
            f"{tps['hybrid eager'] / tps['dense']:.2f}x), load average "
            f"{os.getloadavg()[0]:.1f}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt", type=int, nargs="+", default=[32, 512])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: as is)")
    parser.add_argument("--skip-models", action="store_true", help="the kernel figures only")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"CPU flags: {cpu_flag_summary()}; {torch.get_num_threads()} torch threads")
    kernel_bandwidth(args.repeats)
    layer_step(args.repeats)
    if args.skip_models:
        return
    compare(args.prompt, args.tokens, args.repeats, args.dtype)


if __name__ == "__main__":
    main()
