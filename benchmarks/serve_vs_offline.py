"""One stream's decode speed: `tokenwise serve` (engine-core process, and engine thread) against
the offline engine, in one run.

    python benchmarks/serve_vs_offline.py --shape llama-100m [--rounds 3]

The same random-weight checkpoint as `vs_llamacpp.py` (bf16 where the CPU has native bf16, else
fp32), three ways, taking turns round after round so machine noise hits them alike:

- `offline`: `LLMEngine` in this process, one request at a time;
- `serve (core process)`: `tokenwise serve`, its engine in an engine-core process (the default);
- `serve (core, nice 10)`: the same with `TOKENWISE_SERVER_NICE=10`, the API process yielding
  to its core (server_priority.py; off by default);
- `serve (engine thread)`: `tokenwise serve` with `TOKENWISE_ENABLE_MULTIPROCESSING=0`.

Each round sends every mode the same requests in turn (token-id prompts U[32,384], 128 new
tokens, greedy, ignore_eos); the servers get them from `tokenwise bench serve`'s streaming
client. Prints each mode's median time per output token (TPOT, from the first token to the
last) over the rounds, its decode tok/s as a ratio of the offline engine's, and the CPU flags.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import vs_llamacpp as vs  # noqa: E402

# Room for one 512-token sequence of the largest shape (Qwen3-0.6B in fp32: ~115 MiB).
KV_CACHE_MEMORY, KV_CACHE_MEMORY_BYTES = "160MiB", 160 << 20
# Each server mode and the environment its server starts with (inherited by its processes).
SERVERS = {
    "serve (core process)": {"TOKENWISE_ENABLE_MULTIPROCESSING": "1"},
    "serve (core, nice 10)": {
        "TOKENWISE_ENABLE_MULTIPROCESSING": "1",
        "TOKENWISE_SERVER_NICE": "10",
    },
    "serve (engine thread)": {"TOKENWISE_ENABLE_MULTIPROCESSING": "0"},
}


def offline_tpot_ms(engine: object, prompts: list[list[int]]) -> list[float]:
    from tokenwise import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=vs.OUTPUT_LEN, ignore_eos=True)
    tpots = []
    for i, prompt in enumerate(prompts):
        rid = f"offline-{time.monotonic_ns()}-{i}"
        engine.add_request(rid, prompt, params)
        stamps: list[float] = []
        while engine.has_request(rid):
            for out in engine.step():
                stamps += [time.perf_counter()] * len(
                    out.outputs[0].token_ids if out.outputs else []
                )
        tpots.append((stamps[-1] - stamps[0]) * 1000 / (len(stamps) - 1))
    return tpots


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=vs.SHAPES, default="llama-100m")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=4, help="requests per mode per round")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/tokenwise/llamacpp"))
    p.add_argument(
        "--cpu",
        choices=("native", "avx2"),
        default="native",
        help="avx2: all three modes as on an AVX2+FMA CPU (vs_llamacpp.AVX2_ENV), fp32",
    )
    p.add_argument(
        "--skip-engine-thread",
        action="store_true",
        help="leave out `serve (engine thread)` (the slowest mode) to save time",
    )
    args = p.parse_args(argv)
    server_modes = {
        m: e for m, e in SERVERS.items() if not (args.skip_engine_thread and "thread" in m)
    }
    modes = ("offline", *server_modes)
    flags = vs.cpu_flags(Path("/proc/cpuinfo").read_text())
    if args.cpu == "avx2":
        if "torch" in sys.modules:
            raise SystemExit("serve_vs_offline: --cpu avx2 must be set before torch is imported")
        # Read when torch and the kernels load: the servers inherit them, this process too.
        os.environ.update(vs.AVX2_ENV)
        flags = [f for f in flags if f in vs.AVX2_ISA]
    dtype = "bf16" if vs.has_native_bf16(flags) else "f32"  # vs_llamacpp's names: one cache
    hf_dir = vs.build_hf_checkpoint(args.shape, dtype, Path(args.cache_dir), args.seed)
    torch_dtype = "bfloat16" if dtype == "bf16" else "float32"
    common = [
        sys.executable, "-m", "tokenwise.entrypoints.cli", "serve", "--model", str(hf_dir),
        "--dtype", torch_dtype, "--max-model-len", str(vs.MAX_MODEL_LEN), "--max-num-seqs", "1",
        "--kv-cache-memory", KV_CACHE_MEMORY, "--disable-log-requests", "--host", "127.0.0.1",
    ]  # fmt: skip
    logs = Path(args.cache_dir) / "logs"
    servers = {}
    for i, (mode, env) in enumerate(server_modes.items()):
        port = vs.free_port()
        cmd = [*common, "--port", str(port)]
        servers[mode] = vs.Server(mode, cmd, port, logs / f"svo-{i}.log", env)
    try:
        for srv in servers.values():
            srv.start(600)
        from tokenwise.engine.llm_engine import LLMEngine
        from tokenwise.entrypoints.llm import build_engine_config

        config = build_engine_config(
            str(hf_dir), dtype=torch_dtype, max_model_len=vs.MAX_MODEL_LEN, max_num_seqs=1,
            kv_cache_memory=KV_CACHE_MEMORY_BYTES,
        )  # fmt: skip
        engine = LLMEngine(config, "cpu")
        rng = random.Random(args.seed)
        tpots: dict[str, list[float]] = {m: [] for m in modes}
        for url in [s.url for s in servers.values()]:  # warm-up
            vs.drive(vs.client_args(url, 1, 1, 1, random_input_len=(32, 32), output_len=8), 300)
        offline_tpot_ms(engine, [[rng.randrange(4096) for _ in range(32)]])
        for rnd in range(args.rounds):
            seed = args.seed + 100 + rnd
            prompt_rng = random.Random(seed)
            prompts = [
                [prompt_rng.randrange(4096) for _ in range(prompt_rng.randint(*vs.INPUT_LEN))]
                for _ in range(args.requests)
            ]
            order = modes if rnd % 2 == 0 else tuple(reversed(modes))
            for mode in order:
                if mode == "offline":
                    tpots[mode].append(statistics.mean(offline_tpot_ms(engine, prompts)))
                else:
                    ns = vs.client_args(servers[mode].url, args.requests, 1, seed)
                    tpots[mode].append(vs.drive(ns, 1800)["mean_tpot_ms"])
            load = os.getloadavg()[0]
            line = ", ".join(f"{m} {tpots[m][-1]:.2f} ms" for m in modes)
            print(f"round {rnd + 1} (load average {load:.2f}): {line}", flush=True)
        engine.shutdown()
    finally:
        for srv in servers.values():
            srv.stop()
    base = statistics.median(tpots["offline"])
    print(
        f"\n{args.shape}, {dtype}, one stream, {args.rounds} rounds x {args.requests} requests"
        f"{', AVX2 emulated (--cpu avx2)' if args.cpu == 'avx2' else ''}, "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    print(f"CPU flags: {' '.join(flags) or 'none of ' + ' '.join(vs.CPU_FLAGS)}")
    print(f"{'mode':<24}{'median TPOT (ms)':>18}{'decode tok/s':>14}{'vs offline':>12}")
    for mode in modes:
        tpot = statistics.median(tpots[mode])
        print(f"{mode:<24}{tpot:>18.2f}{1000 / tpot:>14.1f}{base / tpot:>11.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
