"""The pure pieces of benchmarks/vs_llamacpp.py: its arguments and its tables. Nothing here
builds llama.cpp or starts a server."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def vs():
    path = os.path.join(REPO, "benchmarks", "vs_llamacpp.py")
    spec = importlib.util.spec_from_file_location("vs_llamacpp", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["vs_llamacpp"] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("vs_llamacpp", None)


def test_arguments(vs) -> None:
    args = vs.parse_args([])
    assert args.shape == "llama-100m"
    assert [w.name for w in args.workloads] == ["one", "48"]
    assert not args.skip_build and args.llama_server is None
    args = vs.parse_args(
        ["--shape", "qwen3-0.6b", "--workloads", "one", "--skip-build", "--llama-server", "/x"]
    )
    assert args.shape == "qwen3-0.6b" and args.skip_build and args.llama_server == "/x"
    assert [(w.num_prompts, w.concurrency) for w in args.workloads] == [(6, 1)]
    assert [w.name for w in vs.parse_args(["--workloads", "48,one,48"]).workloads] == ["48", "one"]
    for bad in (["--workloads", "2"], ["--workloads", ","], ["--shape", "gpt2"]):
        with pytest.raises(SystemExit):
            vs.parse_args(bad)


def test_cpu_flags_pick_bf16(vs) -> None:
    info = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f amx_bf16 amx_tile\n"
    flags = vs.cpu_flags(info)
    assert flags == ["avx2", "avx512f", "amx_bf16"]
    assert vs.has_native_bf16(flags)
    assert not vs.has_native_bf16(vs.cpu_flags("flags : avx2 fma\n"))


def test_weight_bytes_of_the_shapes(vs) -> None:
    def shape(name: str) -> dict:
        with open(os.path.join(REPO, "benchmarks", "configs", name, "config.json")) as f:
            return json.load(f) | {"vocab_size": vs.VOCAB_SIZE}

    # 12 x (4 x 768^2 + 3 x 768 x 2048 + 2 x 768) + 768 + 4096 x 768 parameters, bf16
    assert vs.decode_weight_bytes(shape("llama-100m"), 2) == 176_199_168
    qwen = vs.decode_weight_bytes(shape("qwen3-0.6b"), 2)
    assert 0.88e9 < qwen < 0.89e9  # Qwen3-0.6B without its 151936-token embedding


def test_table_ratio_and_bandwidth(vs) -> None:
    results = {
        "one": {
            "tokenwise": {"output_throughput": 50.0, "mean_tpot_ms": 10.0},
            "llama-server": {"output_throughput": 200.0, "mean_tpot_ms": 4.0},
        },
        "48": {"tokenwise": {"output_throughput": 1500.0, "mean_tpot_ms": 30.0}},
    }
    table = vs.format_tables(results, weight_bytes=2_000_000_000, header="HEAD")
    lines = table.splitlines()
    assert lines[0] == "HEAD"
    assert "| one stream (6 requests in turn) | 50.0 | 200.0 | 0.25x |" in lines
    assert "| 48 at once | 1,500 | - | - |" in lines  # llama-server missing: no ratio
    assert "| tokenwise serve | 100.0 | 200.0 GB/s |" in lines  # 2 GB x 1000 / 10 ms
    assert "| llama-server | 250.0 | 500.0 GB/s |" in lines
    assert "weight bandwidth" not in vs.format_tables({"48": results["48"]}, 1, "H")


def test_commands_bound_the_servers(vs, tmp_path) -> None:
    args = vs.parse_args(["--threads", "2"])
    args.dtype = "bf16"
    with open(os.path.join(REPO, "benchmarks", "configs", "llama-100m", "config.json")) as f:
        args.shape_cfg = json.load(f)
    w = vs.WORKLOADS["48"]
    llama = vs.server_command("llama-server", args, w, tmp_path, tmp_path / "m.gguf", tmp_path)
    joined = " ".join(llama)
    assert "-fa on -t 2 -np 48 -c 24576" in joined and "--host 127.0.0.1" in joined
    tw = vs.server_command("tokenwise", args, w, tmp_path, tmp_path / "m.gguf", tmp_path)
    assert tw[tw.index("--max-num-seqs") + 1] == "48"
    assert tw[tw.index("--dtype") + 1] == "bfloat16"
    # K and V x 12 layers x 768 x 2 bytes per token, 48 x 512 tokens, +10%: about 0.95 GiB
    assert 900 < int(tw[tw.index("--kv-cache-memory") + 1].removesuffix("MiB")) < 1000
    assert "--enforce-eager" not in tw
    eager_args = vs.parse_args(["--tokenwise-args=--enforce-eager"])
    eager_args.dtype, eager_args.shape_cfg = args.dtype, args.shape_cfg
    eager = vs.server_command("tokenwise", eager_args, w, tmp_path, tmp_path / "m.gguf", tmp_path)
    assert "--enforce-eager" in eager and eager[-1] == str(int(eager[-1]))  # the port stays last


def test_avx2_build_options(vs, monkeypatch) -> None:
    """--cpu avx2 turns every AVX-512 option of ggml off, whatever this CPU has."""
    assert vs.parse_args([]).cpu == "native"
    assert vs.parse_args(["--cpu", "avx2"]).cpu == "avx2"
    with pytest.raises(SystemExit):
        vs.parse_args(["--cpu", "avx512"])
    info = "flags\t\t: fpu avx avx2 fma f16c bmi2 avx512f avx512vbmi avx512_vnni avx512_bf16\n"
    real_read_text = vs.Path.read_text
    monkeypatch.setattr(
        vs.Path, "read_text", lambda p: info if str(p) == "/proc/cpuinfo" else real_read_text(p)
    )
    native = vs.ggml_isa_flags()
    avx2 = vs.ggml_isa_flags("avx2")
    assert "-DGGML_AVX512=ON" in native and "-DGGML_AVX512_VNNI=ON" in native
    for opt in ("AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16", "AVX_VNNI"):
        assert f"-DGGML_{opt}=OFF" in avx2
    for opt in ("AVX", "AVX2", "FMA", "F16C", "BMI2"):
        assert f"-DGGML_{opt}=ON" in avx2
    assert "-DGGML_NATIVE=OFF" in avx2


def test_zmm_check_tells_avx512_code_apart(vs, tmp_path) -> None:
    """The check an AVX2 build of llama.cpp passes: objdump finds zmm registers only in code
    built for AVX-512."""
    if not (shutil.which("gcc") and shutil.which("objdump")):
        pytest.skip("needs gcc and objdump")
    src = tmp_path / "add.c"
    src.write_text(
        "#include <immintrin.h>\n"
        "void add(float *a, const float *b) {\n"
        "  for (int i = 0; i < 1024; i++) a[i] += b[i];\n}\n"
    )
    for isa in ("avx2", "avx512f"):
        flags = ["-O3", f"-m{isa}", "-mprefer-vector-width=512"]
        subprocess.run(
            ["gcc", *flags, "-c", str(src), "-o", str(tmp_path / f"{isa}.o")], check=True
        )
    assert vs.zmm_users([tmp_path / "avx2.o", tmp_path / "avx512f.o"]) == ["avx512f.o"]


def test_repeat_takes_each_servers_median_round(vs) -> None:
    assert vs.parse_args([]).repeat == 1
    assert vs.parse_args(["--repeat", "3"]).repeat == 3
    with pytest.raises(SystemExit):
        vs.parse_args(["--repeat", "0"])
    runs = [
        {"output_throughput": t, "mean_tpot_ms": 1000 / t, "loadavg_1m": load}
        for t, load in ((30.0, 2.0), (10.0, 9.0), (20.0, 4.0))
    ]
    pick = vs.median_run(runs)
    assert pick["output_throughput"] == 20.0 and pick["mean_tpot_ms"] == 50.0
    assert [r["output_throughput"] for r in pick["rounds"]] == [30.0, 10.0, 20.0]  # run order
    assert vs.median_run(runs[:2])["output_throughput"] == 10.0  # the lower middle of two
    table = vs.format_tables({"one": {"tokenwise": pick}}, 1, "H")
    line = "- one stream (6 requests in turn), tokenwise: 30.0 (load 2.0) / 10.0 (load 9.0) / "
    assert line + "20.0 (load 4.0)" in table.splitlines()
    assert "Each round" not in vs.format_tables({"one": {"tokenwise": runs[0]}}, 1, "H")
