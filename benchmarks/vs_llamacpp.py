"""tokenwise serve against llama.cpp's llama-server: same random weights, same client, one run.

    python benchmarks/vs_llamacpp.py --shape llama-100m --workloads one,48

1. llama.cpp comes from the `llama-cpp-python` source package on PyPI (it vendors llama.cpp
   under `vendor/llama.cpp`); only `llama-server` is built, with cmake (for this CPU's vector
   ISA, AMX off: `ggml_isa_flags`), in a cache directory
   (default `~/.cache/tokenwise/llamacpp`); a built binary is reused.
2. A random-weight Hugging Face checkpoint of the shape (`benchmarks/configs/<shape>`, with the
   built-in model's byte-level BPE tokenizer, vocab 4096) is saved in bf16 where the CPU has
   native bf16 (avx512_bf16 / amx_bf16), else fp32, and converted to GGUF of the same dtype by
   the vendored `convert_hf_to_gguf.py` (its pre-tokenizer check is patched at run time to
   "gpt-2", which is what our byte-level BPE is). The embedding rows (tied LM head) of special
   tokens and of partial-UTF-8 tokens are zeroed, so that greedy decoding streams text (see
   `non_text_token_ids`).
3. `tokenwise serve` on the checkpoint and `llama-server -fa on -t <cores> -np <concurrency>` on
   the GGUF run one at a time; `tokenwise bench serve`'s client sends both the same workload
   (streaming `/v1/completions`, token-id prompts U[32,384], 128 new tokens, greedy,
   ignore_eos). Workloads: `one` (6 requests in turn) and `48` (48 at once).
4. `--cpu avx2` measures both as on an AVX2+FMA CPU without AVX-512 (AMD Zen 1-3, Haswell):
   llama.cpp built with its AVX-512 options off (in `build-avx2/`, refused if objdump finds a
   zmm register in it), `tokenwise serve` with its C kernels built for `-march=haswell` and
   torch's kernels held to AVX2 (`AVX2_ENV`), fp32.
5. `--quant q8_0|q4_0`: the GGUF file is quantized by llama.cpp's `llama-quantize --pure`
   (built like llama-server) and both servers load that one file: llama-server runs its
   quantized kernels, tokenwise keeps the layers in the file's integers and scales (int8 /
   int4, `tokenwise.layers.quantization`) with bf16 (or fp32) activations.

6. `--shape qwen3.5-0.8b` (a hybrid: 18 Gated DeltaNet + 6 gated attention layers) also serves
   its dense twin (`configs/qwen3-0.8b-dense`: a Qwen3 with the same hidden size, MLP, depth
   and vocabulary) with `tokenwise serve` in the one-stream workload (`--no-twin`: not), so
   one run gives the hybrid against llama.cpp on the same GGUF file and against the dense
   model in tokenwise. `--repeats N` runs every workload N times, the servers taking turns
   (a shared machine's busy spells hit all alike); each server's best run is printed, every
   run's throughput and load average are in `--output-json`.

Prints, per workload, the output tok/s of each server and their ratio, and for one stream the
weight bandwidth each reaches (bytes of weights read per decoded token x 1000 / mean TPOT).
Every wait is bounded; the servers started here are killed (process group) on any exit.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenwise.tools.llamacpp_source import LLAMA_CPP_PYTHON, SourceUnavailable
from tokenwise.tools.llamacpp_source import llama_cpp_source as fetch_llama_cpp_source

REPO = Path(__file__).resolve().parent.parent
SHAPES = ("llama-100m", "qwen3-0.6b", "qwen3.5-0.8b", "qwen3-0.8b-dense")
# A hybrid shape's dense twin: a Qwen3 of the same hidden size, MLP, depth and vocabulary, every
# layer full attention. A run of the hybrid also serves its twin with tokenwise (one stream),
# so that one run says whether the hybrid decodes faster per token than the dense model.
DENSE_TWIN = {"qwen3.5-0.8b": "qwen3-0.8b-dense"}
TOKENIZER_DIR = REPO / "tokenwise" / "models_data" / "default"  # byte-level BPE, vocab 4096
VOCAB_SIZE = 4096
BOS_ID, EOS_ID = 1, 0
INPUT_LEN = (32, 384)
OUTPUT_LEN = 128
MAX_MODEL_LEN = 512  # longest prompt + output
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
SERVERS = ("tokenwise", "llama-server")
TWIN = "tokenwise-dense"  # the dense twin served by tokenwise (one stream only)
# GGUF types both servers run quantized, and their bytes per weight (a float16 scale per 32).
QUANT_BYTES = {"q8_0": 34 / 32, "q4_0": 18 / 32}


@dataclass(frozen=True)
class Workload:
    name: str
    title: str
    num_prompts: int
    concurrency: int


WORKLOADS = {
    "one": Workload("one", "one stream (6 requests in turn)", 6, 1),
    "48": Workload("48", "48 at once", 48, 48),
}


def _workloads(text: str) -> list[Workload]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in WORKLOADS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated subset of {','.join(WORKLOADS)}, got {text!r}"
        )
    return [WORKLOADS[n] for n in dict.fromkeys(names)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--shape", choices=SHAPES, default="llama-100m")
    p.add_argument("--workloads", type=_workloads, default=_workloads("one,48"), help="one,48")
    p.add_argument(
        "--skip-build", action="store_true", help="never build llama-server (use the cached one)"
    )
    p.add_argument("--llama-server", default=None, metavar="PATH", help="an existing binary")
    p.add_argument(
        "--cache-dir",
        default=os.path.expanduser("~/.cache/tokenwise/llamacpp"),
        help="llama.cpp source and build, checkpoints, GGUF files, server logs",
    )
    p.add_argument(
        "--quant",
        choices=("none", *QUANT_BYTES),
        default="none",
        help="serve one GGUF file quantized by llama-quantize --pure (both servers load it)",
    )
    p.add_argument(
        "--llama-server-args",
        default="",
        metavar="ARGS",
        help="extra llama-server arguments, e.g. --no-repack (its repacking crashes on some CPUs)",
    )
    p.add_argument(
        "--tokenwise-args",
        default="",
        metavar="ARGS",
        help="extra `tokenwise serve` arguments, e.g. --enforce-eager (no CPU graphs)",
    )
    p.add_argument(
        "--cpu",
        choices=("native", "avx2"),
        default="native",
        help="avx2: both sides as on an AVX2+FMA CPU without AVX-512 (llama.cpp built for AVX2 "
        "only in build-avx2/, checked for zmm registers; tokenwise with TOKENWISE_CPU_MARCH="
        "haswell, ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2; fp32)",
    )
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama-server -t")
    p.add_argument(
        "--repeats",
        "--repeat",
        dest="repeats",
        type=int,
        default=1,
        help="runs of each workload, the servers taking turns (best throughput kept)",
    )
    p.add_argument(
        "--no-twin", action="store_true", help="a hybrid shape without its dense twin's run"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=600.0, help="per server start, s")
    p.add_argument("--workload-timeout", type=float, default=1800.0, help="per workload, s")
    p.add_argument("--output-json", default=None, metavar="PATH")
    args = p.parse_args(argv)
    if args.threads < 1:
        p.error("--threads must be at least 1")
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    return args


# ---- pure pieces: weights, flags, tables -------------------------------------------------------


def decode_weight_bytes(cfg: dict[str, Any], bytes_per_param: float) -> int:
    """Bytes of weights one decode step reads: every layer, the final norm and the LM head
    (vocab x hidden, tied or not; the embedding lookup reads one row). A hybrid (Qwen3.5: a
    config with `linear_num_key_heads`) has full attention on every `full_attention_interval`-th
    layer, with its query projection doubled by the output gate, and Gated DeltaNet on the
    others (`hybrid_mixer_params`)."""
    h, n_layers, inter = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]
    n_heads = cfg["num_attention_heads"]
    n_kv = cfg.get("num_key_value_heads") or n_heads
    head_dim = cfg.get("head_dim") or h // n_heads
    hybrid = "linear_num_key_heads" in cfg
    q_out = n_heads * head_dim * (2 if hybrid else 1)
    attn = h * q_out + 2 * h * n_kv * head_dim + n_heads * head_dim * h
    attn += 2 * head_dim if cfg.get("model_type", "").startswith("qwen3") else 0
    mixers = n_layers * attn
    if hybrid:
        n_full = n_layers // cfg["full_attention_interval"]
        mixers = n_full * attn + (n_layers - n_full) * hybrid_mixer_params(cfg)
    params = mixers + n_layers * (3 * h * inter + 2 * h) + h + cfg["vocab_size"] * h
    return int(params * bytes_per_param)


def hybrid_mixer_params(cfg: dict[str, Any]) -> int:
    """Parameters of one Gated DeltaNet mixer: the input projection (q, k, v, z, b, a), the
    depthwise conv, A_log and dt_bias, the gated norm and the output projection."""
    h = cfg["hidden_size"]
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    channels = 2 * nk * dk + nv * dv
    in_proj = h * (channels + nv * dv + 2 * nv)
    return in_proj + channels * cfg["linear_conv_kernel_dim"] + 2 * nv + dv + nv * dv * h


def cpu_flags(cpuinfo: str) -> list[str]:
    """The vector/matrix flags (of CPU_FLAGS) that /proc/cpuinfo's text lists."""
    present: set[str] = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            present |= set(line.split(":", 1)[1].split())
    return [f for f in CPU_FLAGS if f in present]


def has_native_bf16(flags: list[str]) -> bool:
    return "avx512_bf16" in flags or "amx_bf16" in flags


def format_tables(
    results: dict[str, dict[str, dict[str, Any]]],
    weight_bytes: int,
    header: str,
    twin: tuple[str, int] | None = None,
) -> str:
    """`results[workload][server]` holds `output_throughput` and `mean_tpot_ms` (the
    `tokenwise bench serve` aggregate); a missing server prints as '-'. `twin` (shape, weight
    bytes): the dense twin's one-stream row (`results["one"][TWIN]`) and the hybrid / dense
    ratio of decode speed."""
    lines = [header, ""]
    lines += [
        "| workload | tokenwise serve (out tok/s) | llama-server (out tok/s) | tokenwise / llama-server |",
        "|---|---|---|---|",
    ]
    for name, by_server in results.items():
        tw, lc = (by_server.get(s, {}).get("output_throughput") for s in SERVERS)
        ratio = f"{tw / lc:.2f}x" if tw and lc else "-"
        title = WORKLOADS[name].title if name in WORKLOADS else name
        lines.append(f"| {title} | {_num(tw)} | {_num(lc)} | {ratio} |")
    rounds = [
        f"{WORKLOADS[n].title if n in WORKLOADS else n}, {s}: "
        + " / ".join(f"{tok_s:.1f} (load {load:.1f})" for tok_s, load in run["runs"])
        for n, by_server in results.items()
        for s, run in by_server.items()
        if len(run.get("runs", ())) > 1
    ]
    if rounds:
        lines += [
            "",
            "Each run (out tok/s, 1-minute load average after it; the best is in the table):",
            "",
        ]
        lines += [f"- {line}" for line in rounds]
    if "one" in results:
        lines += [
            "",
            f"One stream, weight bandwidth ({weight_bytes / 1e6:.0f} MB of weights read per "
            "decoded token x decode tok/s; decode tok/s = 1000 / mean TPOT):",
            "",
            "| server | decode tok/s | weight bandwidth |",
            "|---|---|---|",
        ]
        for server in SERVERS:
            tpot = results["one"].get(server, {}).get("mean_tpot_ms")
            tps = 1000.0 / tpot if tpot else None
            bw = f"{weight_bytes * tps / 1e9:.1f} GB/s" if tps else "-"
            label = "tokenwise serve" if server == "tokenwise" else server
            lines.append(f"| {label} | {_num(tps)} | {bw} |")
        if twin is not None:
            lines += _twin_rows(results["one"], *twin)
    return "\n".join(lines)


def _twin_rows(one: dict[str, dict[str, Any]], shape: str, weight_bytes: int) -> list[str]:
    """The dense twin's bandwidth row, and the hybrid's decode speed against it."""
    tpots = [one.get(s, {}).get("mean_tpot_ms") for s in ("tokenwise", TWIN)]
    tps = [1000.0 / t if t else None for t in tpots]
    bw = f"{weight_bytes * tps[1] / 1e9:.1f} GB/s" if tps[1] else "-"
    lines = [f"| tokenwise serve, dense twin {shape} ({weight_bytes / 1e6:.0f} MB) |"]
    lines[0] += f" {_num(tps[1])} | {bw} |"
    if tps[0] and tps[1]:
        lines += ["", f"Hybrid / dense twin decode speed in tokenwise: {tps[0] / tps[1]:.2f}x"]
    return lines


def _num(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if value < 1000 else f"{value:,.0f}"


# ---- llama.cpp: source, build, conversion ------------------------------------------------------


def _run(cmd: list[str], timeout: float, what: str, **kw: Any) -> None:
    print(f"$ {' '.join(map(str, cmd))}", flush=True)
    try:
        subprocess.run(cmd, check=True, timeout=timeout, **kw)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"vs_llamacpp: {what} took over {timeout:.0f} s") from None
    except subprocess.CalledProcessError as exc:
        raise SystemExit(f"vs_llamacpp: {what} failed (exit {exc.returncode})") from None


def _nice() -> list[str]:
    """Builds and conversions run at the lowest priority: the machine may be shared."""
    return ["nice", "-n", "19"] if shutil.which("nice") else []


def llama_cpp_source(cache: Path) -> Path:
    """The vendored llama.cpp of the llama-cpp-python sdist, downloaded once
    (`tokenwise.tools.llamacpp_source`, which `make test` runs for the GGUF tests too)."""
    try:
        return fetch_llama_cpp_source(cache)
    except SourceUnavailable as exc:
        raise SystemExit(f"vs_llamacpp: {exc}") from None


# /proc/cpuinfo flag -> ggml's cmake option. AMX stays off: on the development VMs the AMX tile
# kernels are listed but raise SIGILL as soon as llama.cpp repacks Q8_0 / Q4_0 weights.
GGML_ISA = {
    "avx": "GGML_AVX", "avx2": "GGML_AVX2", "fma": "GGML_FMA", "f16c": "GGML_F16C",
    "bmi2": "GGML_BMI2", "avx512f": "GGML_AVX512", "avx512vbmi": "GGML_AVX512_VBMI",
    "avx512_vnni": "GGML_AVX512_VNNI", "avx512_bf16": "GGML_AVX512_BF16", "avx_vnni": "GGML_AVX_VNNI",
}  # fmt: skip


# What `--cpu avx2` keeps of this CPU's flags: an AVX2+FMA CPU (Haswell, Zen 1-3).
AVX2_ISA = {"avx", "avx2", "fma", "f16c", "bmi2"}
# The environment of `tokenwise serve` under `--cpu avx2`: the C kernels and torch's own
# kernels (ATen, oneDNN) on their AVX2 paths.
AVX2_ENV = {
    "TOKENWISE_CPU_MARCH": "haswell",
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}


def ggml_isa_flags(cpu: str = "native") -> list[str]:
    """cmake options for this CPU's vector ISA (`cpu` "avx2": no more than AVX2+FMA), without
    AMX (GGML_NATIVE would turn it on)."""
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    present = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            present |= set(line.split(":", 1)[1].split())
    if cpu == "avx2":
        present &= AVX2_ISA
    flags = [
        "-DGGML_NATIVE=OFF",
        "-DGGML_AMX_TILE=OFF",
        "-DGGML_AMX_INT8=OFF",
        "-DGGML_AMX_BF16=OFF",
    ]
    return flags + [f"-D{opt}={'ON' if cpu in present else 'OFF'}" for cpu, opt in GGML_ISA.items()]


def zmm_users(paths: list[Path]) -> list[str]:
    """The files among `paths` whose machine code names a 512-bit register (objdump)."""
    found = []
    for path in paths:
        out = subprocess.run(
            ["objdump", "-d", "--no-show-raw-insn", str(path)],
            capture_output=True, text=True, timeout=600, check=True,
        ).stdout  # fmt: skip
        if "%zmm" in out:
            found.append(path.name)
    return found


def check_avx2_build(bin_dir: Path) -> None:
    """Refuse an AVX2 build of llama.cpp that holds AVX-512 code (a flag the sdist ignored)."""
    files = [p for p in sorted(bin_dir.iterdir()) if p.is_file() and not p.suffix == ".py"]
    if found := zmm_users(files):
        raise SystemExit(f"vs_llamacpp: the AVX2 build uses zmm registers in {', '.join(found)}")


def ensure_llama_server(
    cache: Path, skip_build: bool, target: str = "llama-server", cpu: str = "native"
) -> Path:
    src = llama_cpp_source(cache)
    build_dir = "build" if cpu == "native" else f"build-{cpu}"
    binary = src / build_dir / "bin" / target
    if binary.exists():
        return binary
    if skip_build:
        raise SystemExit(f"vs_llamacpp: --skip-build but no {binary}; build it or --llama-server")
    if not shutil.which("cmake"):
        raise SystemExit(
            "vs_llamacpp: cmake is missing; install it (apt-get update && apt-get install -y "
            "cmake) and run again"
        )
    configure = ["cmake", "-B", build_dir, "-DLLAMA_CURL=OFF", *ggml_isa_flags(cpu)]
    _run([*_nice(), *configure, "-DCMAKE_BUILD_TYPE=Release"], 900, "cmake configure", cwd=src)
    jobs = str(os.cpu_count() or 2)
    build = ["cmake", "--build", build_dir, "--target", target, "-j", jobs]
    _run([*_nice(), *build], 7200, f"building {target}", cwd=src)
    if not binary.exists():
        raise SystemExit(f"vs_llamacpp: the build finished without {binary}")
    if cpu == "avx2":
        check_avx2_build(binary.parent)
    return binary


CONVERT_SHIM = """
import sys
root = sys.argv[1]
sys.path[:0] = [root, root + "/gguf-py"]
from conversion import base
# Our byte-level BPE's pre-tokenizer hash is in no list: it is GPT-2's byte-level split.
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
# Llama's vocabulary tries sentencepiece first and takes BPE on FileNotFoundError only; without
# the package installed the import fails first. There is no tokenizer.model here: say so.
_spm = base.TextModel._create_vocab_sentencepiece
def _no_spm(self):
    if not (self.dir_model / "tokenizer.model").is_file():
        raise FileNotFoundError("no tokenizer.model (byte-level BPE)")
    return _spm(self)
base.TextModel._create_vocab_sentencepiece = _no_spm
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
convert_hf_to_gguf.main()
"""


def build_checkpoints(shape: str, dtype: str, cache: Path, seed: int) -> tuple[Path, Path]:
    """The random-weight HF checkpoint and its GGUF conversion (cached by shape and dtype)."""
    hf_dir = build_hf_checkpoint(shape, dtype, cache, seed)
    gguf = hf_dir.parent / f"model-{dtype}.gguf"
    if not gguf.exists():
        src = llama_cpp_source(cache)
        tmp_gguf = gguf.with_suffix(".tmp")
        cmd = [*_nice(), sys.executable, "-c", CONVERT_SHIM, str(src), str(hf_dir)]
        cmd += ["--outtype", dtype, "--outfile", str(tmp_gguf)]
        if "linear_num_key_heads" in shape_config(shape):
            cmd.append("--no-mtp")  # a random checkpoint has no multi-token-prediction head
        _run(cmd, 1800, "convert_hf_to_gguf.py")
        tmp_gguf.rename(gguf)
    return hf_dir, gguf


def quantized_gguf(gguf: Path, quant: str, quantize_bin: Path) -> Path:
    """`gguf` quantized to `quant` by llama-quantize --pure (every matrix, the embedding and
    LM head included, in that one type), cached beside it."""
    out = gguf.with_name(f"model-{quant}.gguf")
    if not out.exists():
        tmp = out.with_suffix(".tmp")
        cmd = [*_nice(), str(quantize_bin), "--pure", str(gguf), str(tmp), quant.upper()]
        _run(cmd, 1800, "llama-quantize")
        tmp.rename(out)
    return out


def build_hf_checkpoint(shape: str, dtype: str, cache: Path, seed: int) -> Path:
    """The random-weight HF checkpoint of `shape` (cached by shape, dtype and seed); a new one
    makes its GGUF conversion stale."""
    out = cache / "models" / f"{shape}-{dtype}-seed{seed}-textonly"
    hf_dir, gguf = out / "hf", out / f"model-{dtype}.gguf"
    if not (hf_dir / "model.safetensors").exists():
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = shape_config(shape) | {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID}
        cfg["torch_dtype"] = cfg["dtype"] = "bfloat16" if dtype == "bf16" else "float32"
        tmp = out / "hf.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        config = AutoConfig.from_pretrained(tmp, local_files_only=True)
        torch.manual_seed(seed)
        torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype).eval()
        with torch.no_grad():  # tied: the LM head's rows too
            model.get_input_embeddings().weight[non_text_token_ids()] = 0.0
        model.save_pretrained(tmp)
        del model
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(TOKENIZER_DIR / name, tmp / name)
        shutil.rmtree(hf_dir, ignore_errors=True)
        tmp.rename(hf_dir)
        gguf.unlink(missing_ok=True)
    return hf_dir


def non_text_token_ids() -> list[int]:
    """Ids of the tokenizer's special tokens and of tokens that are no whole UTF-8 text (lone
    bytes of a multi-byte character). Greedy decoding of random weights repeats one token; when
    that token is one of these, a server streams no text at all (it holds back incomplete UTF-8)
    and the client counts the request as failed. Their embedding rows (= the tied LM head's)
    are zeroed, so their logits are 0 and greedy decoding picks text tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    bad = []
    for i in range(len(tok)):
        text = tok.decode([i], skip_special_tokens=True)
        if not text or "\ufffd" in text:
            bad.append(i)
    return bad


# ---- servers and the client --------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One server process in its own process group; `stop()` kills the whole group."""

    def __init__(
        self, name: str, cmd: list[str], port: int, log_path: Path, env: dict | None = None
    ) -> None:
        self.name, self.cmd, self.port, self.log_path = name, cmd, port, log_path
        self.env = env
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float) -> None:
        import httpx

        print(f"$ {' '.join(self.cmd)}  (log: {self.log_path})", flush=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                env=None if self.env is None else {**os.environ, **self.env},
            )  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode} during start-up:\n"
                    f"{self.log_tail()}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=5.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not healthy after {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue


def client_args(url: str, num_prompts: int, concurrency: int, seed: int, **kw: Any) -> Any:
    """The `tokenwise bench serve` arguments for one workload."""
    ns = argparse.Namespace(
        base_url=url,
        model=None,
        api_key=None,
        num_prompts=num_prompts,
        max_concurrency=concurrency,
        request_rate=float("inf"),
        input_len=INPUT_LEN[0],
        random_input_len=INPUT_LEN,
        output_len=OUTPUT_LEN,
        random_output_len=None,
        prompt_type="token-ids",
        vocab_size=VOCAB_SIZE,
        seed=seed,
        timeout=600.0,
    )
    for key, value in kw.items():
        setattr(ns, key, value)
    return ns


def drive(ns: Any, timeout: float) -> dict[str, Any]:
    from tokenwise.benchmarks.serve import run_benchmark

    async def bounded() -> dict[str, Any]:
        return await asyncio.wait_for(run_benchmark(ns), timeout)

    try:
        results = asyncio.run(bounded())
    except asyncio.TimeoutError:
        raise TimeoutError(f"the workload did not finish in {timeout:.0f} s") from None
    lo, hi = ns.random_output_len or (ns.output_len, ns.output_len)
    if results["failed"] or results["total_output_tokens"] < ns.num_prompts * lo:
        raise RuntimeError(
            f"{results['failed']} of {ns.num_prompts} requests failed, "
            f"{results['total_output_tokens']} output tokens (expected >= {ns.num_prompts * lo}): "
            f"{results.get('first_error', 'short outputs')}"
        )
    return results


def server_command(
    server: str, args: argparse.Namespace, w: Workload, hf_dir: Path, gguf: Path, binary: Path
) -> list[str]:
    port = str(free_port())
    if server == "tokenwise":
        kv_mib = kv_cache_mib(args.shape_cfg, args.dtype, w.concurrency)
        # Quantized: the very GGUF file llama-server loads (its layers stay quantized).
        model = [str(gguf), "--tokenizer", str(hf_dir)] if args.quant != "none" else [str(hf_dir)]
        return [
            sys.executable, "-m", "tokenwise.entrypoints.cli", "serve",
            "--model", *model, "--dtype", "bfloat16" if args.dtype == "bf16" else "float32",
            "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(w.concurrency),
            "--kv-cache-memory", f"{kv_mib}MiB", "--disable-log-requests",
            *args.tokenwise_args.split(), "--host", "127.0.0.1", "--port", port,
        ]  # fmt: skip
    return [
        str(binary), "-m", str(gguf), "-fa", "on", "-t", str(args.threads),
        "-np", str(w.concurrency), "-c", str(w.concurrency * MAX_MODEL_LEN),
        *args.llama_server_args.split(), "--host", "127.0.0.1", "--port", port,
    ]  # fmt: skip


def kv_cache_mib(cfg: dict[str, Any], dtype: str, concurrency: int) -> int:
    """Room for `concurrency` full-length sequences (+10%), as llama-server's -c gives; for a
    hybrid also four recurrent states per sequence (live slot and prefix-cache snapshots)."""
    n_heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
    n_kv = cfg.get("num_key_value_heads") or n_heads
    itemsize = 2 if dtype == "bf16" else 4
    per_token = 2 * cfg["num_hidden_layers"] * n_kv * head_dim * itemsize
    states = 0
    if "linear_num_key_heads" in cfg:
        nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
        dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
        conv = (cfg["linear_conv_kernel_dim"] - 1) * (2 * nk * dk + nv * dv)
        n_gdn = (
            cfg["num_hidden_layers"] - cfg["num_hidden_layers"] // cfg["full_attention_interval"]
        )
        states = n_gdn * (conv + nv * dk * dv) * itemsize * 4 * concurrency
    return int((per_token * concurrency * MAX_MODEL_LEN * 1.1 + states) / 2**20) + 16


def run_workloads(
    args: argparse.Namespace,
    hf_dir: Path,
    gguf: Path,
    binary: Path,
    twin: tuple[argparse.Namespace, Path, Path] | None = None,
) -> dict[str, dict[str, dict[str, Any]]]:
    """Each workload on each server, `args.repeats` times with the servers taking turns (so
    that a busy spell of a shared machine hits all alike); a server's best run is kept, with
    every run's throughput and load average in `runs`. `twin` (its args, checkpoint, GGUF
    file): the dense twin, served by tokenwise in the one-stream workload."""
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for w in args.workloads:
        results[w.name] = {}
        entries = [(server, server, args, hf_dir, gguf) for server in SERVERS]
        if twin is not None and w.name == "one":
            entries.append((TWIN, "tokenwise", *twin))
        for _ in range(args.repeats):
            for label, server, entry_args, entry_hf, entry_gguf in entries:
                r = run_one(server, entry_args, w, entry_hf, entry_gguf, binary, label)
                best = results[w.name].get(label)
                runs = (best or {}).get("runs", [])
                runs.append((round(r["output_throughput"], 2), r["loadavg_1m"]))
                if best is None or r["output_throughput"] > best["output_throughput"]:
                    best = r
                results[w.name][label] = best | {"runs": runs}
    return results


def run_one(
    server: str,
    args: argparse.Namespace,
    w: Workload,
    hf_dir: Path,
    gguf: Path,
    binary: Path,
    label: str,
) -> dict[str, Any]:
    """One server started, warmed up, measured on workload `w` and stopped."""
    cmd = server_command(server, args, w, hf_dir, gguf, binary)
    port = int(cmd[-1])
    env = AVX2_ENV if args.cpu == "avx2" and server == "tokenwise" else None
    log = Path(args.cache_dir) / "logs" / f"{args.shape}-{w.name}-{server}.log"
    srv = Server(server, cmd, port, log, env)
    try:
        srv.start(args.startup_timeout)
        warm = client_args(srv.url, 2, 2, args.seed + 1, random_input_len=(32, 32), output_len=8)
        drive(warm, args.workload_timeout)
        ns = client_args(srv.url, w.num_prompts, w.concurrency, args.seed)
        r = drive(ns, args.workload_timeout)
    except (RuntimeError, TimeoutError) as exc:
        raise SystemExit(f"vs_llamacpp: {label}, workload {w.name}: {exc}") from None
    finally:
        srv.stop()
    # Other processes on the cores (a shared machine) slow llama.cpp's spinning thread
    # barriers badly: the 1-minute load average after the run tells such runs apart.
    r["loadavg_1m"] = os.getloadavg()[0]
    print(
        f"{label:>15} {w.title}: {r['output_throughput']:.1f} out tok/s, "
        f"mean TPOT {r['mean_tpot_ms']:.2f} ms, mean TTFT {r['mean_ttft_ms']:.0f} ms, "
        f"load average {r['loadavg_1m']:.2f}",
        flush=True,
    )
    return r


def shape_config(shape: str) -> dict[str, Any]:
    """`benchmarks/configs/<shape>`'s config with the benchmark's vocabulary."""
    path = REPO / "benchmarks" / "configs" / shape / "config.json"
    return json.loads(path.read_text()) | {"vocab_size": VOCAB_SIZE}


def model_files(
    args: argparse.Namespace, shape: str, tokenwise_only: bool = False
) -> tuple[Path, Path]:
    """`shape`'s checkpoint and the GGUF file the servers load (quantized where asked; none
    for a model only tokenwise serves from its checkpoint)."""
    cache = Path(args.cache_dir)
    if tokenwise_only and args.quant == "none":  # served from the checkpoint: no GGUF file
        return build_hf_checkpoint(shape, args.dtype, cache, args.seed), Path(os.devnull)
    hf_dir, gguf = build_checkpoints(shape, args.dtype, cache, args.seed)
    if args.quant != "none":
        quantize_bin = ensure_llama_server(cache, args.skip_build, "llama-quantize", args.cpu)
        gguf = quantized_gguf(gguf, args.quant, quantize_bin)
    return hf_dir, gguf


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM runs the `finally` blocks (and so stops the servers) like Ctrl-C does.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    cache = Path(args.cache_dir)
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    flags = cpu_flags(cpuinfo)
    if args.cpu == "avx2":
        flags = [f for f in flags if f in AVX2_ISA]  # what the builds may use
    args.dtype = "bf16" if has_native_bf16(flags) else "f32"
    args.shape_cfg = shape_config(args.shape)
    if args.llama_server:
        binary = Path(args.llama_server)
        if not binary.exists():
            raise SystemExit(f"vs_llamacpp: no llama-server at {binary}")
    else:
        binary = ensure_llama_server(cache, args.skip_build, cpu=args.cpu)
    hf_dir, gguf = model_files(args, args.shape)
    bytes_per_param = (
        QUANT_BYTES[args.quant] if args.quant != "none" else 2 if args.dtype == "bf16" else 4
    )
    twin, twin_row = None, None
    if (twin_shape := DENSE_TWIN.get(args.shape)) and not args.no_twin:
        twin_args = argparse.Namespace(**vars(args))
        twin_args.shape, twin_args.shape_cfg = twin_shape, shape_config(twin_shape)
        twin = (twin_args, *model_files(args, twin_shape, tokenwise_only=True))
        twin_row = (twin_shape, decode_weight_bytes(twin_args.shape_cfg, bytes_per_param))
    results = run_workloads(args, hf_dir, gguf, binary, twin)
    weight_bytes = decode_weight_bytes(args.shape_cfg, bytes_per_param)
    model_name = next(
        (ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines() if ln.startswith("model name")),
        "unknown CPU",
    )
    header = (
        f"{args.shape} (vocab {VOCAB_SIZE}, random weights), {args.dtype}"
        f"{'' if args.quant == 'none' else ' activations, weights ' + args.quant.upper()}, "
        f"{datetime.date.today().isoformat()}, {model_name}, {os.cpu_count()} cores, "
        f"CPU flags: {' '.join(flags) or 'none of ' + ','.join(CPU_FLAGS)}; llama-server from "
        f"{LLAMA_CPP_PYTHON} (-fa on -t {args.threads}, -np = concurrency"
        f"{' ' + args.llama_server_args if args.llama_server_args else ''})"
        f"{'; tokenwise serve ' + args.tokenwise_args if args.tokenwise_args else ''}"
        f"{'; AVX2 emulated (--cpu avx2)' if args.cpu == 'avx2' else ''}"
    )
    print()
    print(format_tables(results, weight_bytes, header, twin_row))
    if args.output_json:
        out = {"header": header, "weight_bytes": weight_bytes, "results": results}
        out["dense_twin"] = twin_row
        Path(args.output_json).write_text(json.dumps(out, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
