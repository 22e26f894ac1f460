"""`tokenwise bench ...` end to end on a tiny checkpoint, and the benchmarks' pure helpers.

The CLI runs as a subprocess, as a user runs it: exit status, the printed line and the JSON
are what scripts consume. No assertion depends on speed.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import os
import re
import subprocess
import sys

import pytest

from tests.tiny_checkpoints import build_tiny_checkpoint
from tokenwise.benchmarks.common import BenchRequest, make_workload, parse_len_range, percentile
from tokenwise.benchmarks.hf_baselines import EngineRun, hf_batches, hf_num_blocks
from tokenwise.benchmarks.roofline import ModelShape, request_flops, workload_flops
from tokenwise.benchmarks.serve import RequestRecord, aggregate, request_metrics, run_benchmark
from tokenwise.entrypoints.cli import build_parser

THROUGHPUT_LINE = re.compile(
    r"^Throughput: [\d.]+ requests/s, [\d.]+ total tokens/s, [\d.]+ output tokens/s$", re.M
)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "tokenwise.entrypoints.cli", "bench", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("bench"))


# ---- the CLI -----------------------------------------------------------------------------------


def test_throughput_counts_match_the_workload(tiny_model: str, tmp_path) -> None:
    out = tmp_path / "t.json"
    common = ["--model", tiny_model, "--dtype", "float32", "--seed", "3"]
    proc = _cli("throughput", *common, "--num-prompts", "5", "--random-input-len", "3:20",
                "--output-len", "7", "--output-json", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert THROUGHPUT_LINE.search(proc.stdout), proc.stdout
    data = json.loads(out.read_text())
    for key in ("elapsed_time", "requests_per_second", "tokens_per_second",
                "output_tokens_per_second", "total_num_tokens"):  # fmt: skip
        assert data[key] > 0
    assert data["num_requests"] == 5
    assert data["num_output_tokens"] == 5 * 7  # EOS ignored: every request runs to its length
    vocab = json.loads(open(os.path.join(tiny_model, "config.json")).read())["vocab_size"]
    expected = make_workload(5, (3, 20), (7, 7), vocab, seed=3)  # the same seeded prompts
    assert data["num_prompt_tokens"] == sum(r.prompt_len for r in expected)
    assert data["total_num_tokens"] == data["num_prompt_tokens"] + 35


def test_latency_reports_each_iteration(tiny_model: str, tmp_path) -> None:
    out = tmp_path / "l.json"
    proc = _cli("latency", "--model", tiny_model, "--dtype", "float32", "--batch-size", "3",
                "--input-len", "6", "--output-len", "4", "--num-iters-warmup", "1",
                "--num-iters", "3", "--output-json", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^Avg latency: [\d.]+ seconds$", proc.stdout, re.M), proc.stdout
    for pct in (50, 90, 99):
        assert re.search(rf"^{pct}% percentile latency: [\d.]+ seconds$", proc.stdout, re.M)
    data = json.loads(out.read_text())
    assert len(data["latencies"]) == 3
    assert data["num_output_tokens_per_iter"] == [3 * 4] * 3
    assert data["avg_latency"] == pytest.approx(sum(data["latencies"]) / 3)
    p = data["percentiles"]
    assert min(data["latencies"]) <= p["50"] <= p["90"] <= p["99"] <= max(data["latencies"])


@pytest.mark.parametrize(
    "args",
    [
        ["throughput", "--num-prompts", "0"],
        ["throughput", "--random-input-len", "5:2"],
        ["throughput", "--input-len", "4", "--random-input-len", "2:3"],
        ["latency", "--num-iters", "0"],
        ["throughput", "--model", "/nonexistent/model-dir", "--num-prompts", "2"],
        ["serve", "--base-url", "localhost:8000"],
    ],
)
def test_bad_arguments_fail_with_one_line(args: list[str]) -> None:
    proc = _cli(*args)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert "error:" in lines[-1] and len(lines[-1]) < 300


# ---- shared helpers ----------------------------------------------------------------------------


def test_parse_len_range() -> None:
    assert parse_len_range("3:9") == (3, 9)
    assert parse_len_range("7") == (7, 7)
    for bad, message in (
        ("5:2", "MIN must not exceed MAX"),
        ("0:4", "lengths must be at least 1"),
        ("a:b", "expected MIN:MAX or N"),
        ("1:2:3", "expected MIN:MAX or N"),
        ("", "expected MIN:MAX or N"),
    ):
        with pytest.raises(argparse.ArgumentTypeError, match=f"{message}, got {bad!r}"):
            parse_len_range(bad)


def test_workload_is_seeded_and_within_ranges() -> None:
    a = make_workload(300, (3, 5), (1, 2), vocab_size=11, seed=7)
    assert a == make_workload(300, (3, 5), (1, 2), vocab_size=11, seed=7)
    assert a != make_workload(300, (3, 5), (1, 2), vocab_size=11, seed=8)
    assert {r.prompt_len for r in a} == {3, 4, 5}  # inclusive at both ends
    assert {r.output_len for r in a} == {1, 2}
    ids = {t for r in a for t in r.prompt_token_ids}
    assert ids == set(range(11))
    with pytest.raises(ValueError, match="num_prompts must be at least 1, got 0"):
        make_workload(0, (1, 1), (1, 1), 10)


def test_percentile_interpolates_like_numpy() -> None:
    values = [4.0, 1.0, 3.0, 2.0]  # sorted 1 2 3 4: rank (n-1) * p
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert math.isnan(percentile([], 50))


def test_flop_model_on_a_hand_computed_shape() -> None:
    shape = ModelShape(hidden=4, layers=2, heads=2, kv_heads=1, head_dim=2, intermediate=8,
                       vocab=10)  # fmt: skip
    # q 4x4 + k 4x2 + v 4x2 + o 4x4 = 48; mlp 3 x 4 x 8 = 96; per layer 144; 2 layers 288.
    assert shape.body_params == 288
    # prompt 3, output 2: 4 processed tokens -> 2*288*4 = 2304; lm_head 2*4*10*2 = 160;
    # attention 4 * 2 layers * 4 (q_dim) * (1+2+3+4) = 320.
    assert request_flops(shape, 3, 2) == 2304 + 160 + 320
    requests = [BenchRequest([0, 1, 2], 2), BenchRequest([5], 1)]
    # second: 1 processed token: 2*288 + 2*4*10 + 4*2*4*1 = 576 + 80 + 32
    assert workload_flops(shape, requests) == 2784 + 688
    qwen = ModelShape.from_config({"hidden_size": 8, "num_hidden_layers": 1,
                                   "num_attention_heads": 4, "num_key_value_heads": 2,
                                   "head_dim": 4, "intermediate_size": 16, "vocab_size": 3})  # fmt: skip
    assert (qwen.heads * qwen.head_dim, qwen.kv_heads * qwen.head_dim) == (16, 8)
    assert qwen.layer_matmul_params == 8 * (16 + 16) + 16 * 8 + 3 * 8 * 16


# ---- compare_hf.py and its HF baselines -------------------------------------------------------------------


@pytest.fixture(scope="module")
def compare_hf():
    path = os.path.join(REPO, "benchmarks", "compare_hf.py")
    spec = importlib.util.spec_from_file_location("compare_hf", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hf_batches_left_pad_and_take_the_longest_output() -> None:
    work = [BenchRequest([7, 8], 3), BenchRequest([9], 5), BenchRequest([1, 2, 3], 2)]
    batches = hf_batches(work, batch_size=2, pad_id=0)
    assert batches[0] == ([[7, 8], [0, 9]], [[1, 1], [0, 1]], 5)
    assert batches[1] == ([[1, 2, 3]], [[1, 1, 1]], 2)


def test_compare_summary_ratio_and_roofline(compare_hf, capsys: pytest.CaptureFixture) -> None:
    run = EngineRun
    runs = {
        "tokenwise": [run("tokenwise", 2.0, 100, 300), run("tokenwise", 4.0, 100, 300),
                      run("tokenwise", 1.0, 100, 300)],  # median run: 2 s
        "hf": [run("hf", 10.0, 100, 300)],
        "hf_batch": [run("hf_batch", error="RuntimeError: boom")],
    }  # fmt: skip
    rows = compare_hf.summarize_runs(runs, flops=1e9, matmul_rate=1e9)
    assert rows["tokenwise"]["elapsed"] == 2.0
    assert rows["tokenwise"]["output_tok_s"] == 50.0 and rows["tokenwise"]["total_tok_s"] == 200.0
    assert rows["tokenwise"]["vs_hf"] == pytest.approx(5.0)
    assert rows["tokenwise"]["roofline_fraction"] == pytest.approx(0.5)
    assert rows["hf_batch"] == {"error": "RuntimeError: boom"}
    table = compare_hf.format_table(rows)
    assert "boom" in table and "5.00x" in table
    targets = compare_hf.format_targets(rows, "float32").splitlines()
    assert targets[0] == "target tokenwise vs HF generate: 5.00x (>= 2.50x): met"
    assert targets[1] == "target tokenwise vs HF generate_batch: - (>= 5.00x): not run"
    assert targets[2] == "target roofline share, float32: 50.0% (>= 70.0%): NOT met"
    assert len(compare_hf.format_targets(rows, "bfloat16").splitlines()) == 2
    # 2 (K,V) x 2 layers x 1 kv head x 4 dims x 8 tokens x 2 bytes = 256 bytes per block
    shape = ModelShape(4, 2, 2, 1, 4, 8, 10)
    assert hf_num_blocks(shape, 1000, page_size=8, itemsize=2) == 3
    with pytest.raises(SystemExit, match="^2$"):  # argparse's exit status for a usage error
        compare_hf.parse_args(["--engines", "tokenwise,vllm"])
    assert "argument --engines: engines are tokenwise, hf, hf_batch; got 'tokenwise,vllm'" in (
        capsys.readouterr().err
    )


# ---- bench serve -------------------------------------------------------------------------------


def test_request_metrics_from_timestamps() -> None:
    rec = RequestRecord(start=10.0, prompt_len=5, chunk_times=[10.5, 10.7, 11.0, 11.6])
    rec.output_tokens = 4
    m = request_metrics(rec)
    assert m["ttft"] == pytest.approx(0.5)
    assert m["e2e"] == pytest.approx(1.6)
    assert m["tpot"] == pytest.approx((1.6 - 0.5) / 3)
    assert m["itls"] == pytest.approx([0.2, 0.3, 0.6])
    single = RequestRecord(start=0.0, prompt_len=1, chunk_times=[0.25])
    assert request_metrics(single)["tpot"] is None  # no token after the first


def test_aggregate_pools_requests() -> None:
    a = RequestRecord(start=0.0, prompt_len=5, chunk_times=[0.1, 0.3, 0.4], output_tokens=3)
    b = RequestRecord(start=1.0, prompt_len=7, chunk_times=[1.3, 1.4])  # no usage: 2 chunks
    failed = RequestRecord(start=0.0, prompt_len=9, error="HTTP 500: nope")
    r = aggregate([a, b, failed], duration=2.0)
    assert (r["completed"], r["failed"]) == (2, 1)
    assert (r["total_input_tokens"], r["total_output_tokens"]) == (12, 5)
    assert r["request_throughput"] == 1.0 and r["output_throughput"] == 2.5
    assert r["total_token_throughput"] == pytest.approx(8.5)
    assert r["mean_ttft_ms"] == pytest.approx(200.0)  # (100 + 300) / 2
    assert r["median_itl_ms"] == pytest.approx(100.0)  # gaps 200, 100, 100
    assert r["mean_tpot_ms"] == pytest.approx((150.0 + 100.0) / 2)  # (0.4-0.1)/2, (0.4-0.3)/1
    assert r["mean_e2el_ms"] == pytest.approx(400.0)
    assert r["first_error"] == "HTTP 500: nope"


def _serve_args(*extra: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", "serve", *extra])


def test_serve_argument_handling(capsys: pytest.CaptureFixture) -> None:
    args = _serve_args("--base-url", "http://h:1/", "--num-prompts", "3")
    assert args.base_url == "http://h:1" and args.max_concurrency is None
    for bad in (["--max-concurrency", "0"], ["--request-rate", "-1"], ["--prompt-type", "x"]):
        with pytest.raises(SystemExit, match="^2$"):  # argparse's exit status for a usage error
            _serve_args(*bad)
        assert f"argument {bad[0]}:" in capsys.readouterr().err


def test_serve_against_a_fake_streaming_server() -> None:
    import httpx

    bodies: list[dict] = []
    in_flight = [0, 0]  # now, max

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny"}]})
        body = json.loads(request.content)
        bodies.append(body)

        async def stream():
            in_flight[0] += 1
            in_flight[1] = max(in_flight)
            for i in range(body["max_tokens"]):
                await asyncio.sleep(0.001)
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': f't{i}'}]})}\n\n"
            in_flight[0] -= 1  # before the last chunk: the client stops reading at [DONE]
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n"

        return httpx.Response(200, content=(s.encode() async for s in stream()))

    args = _serve_args("--num-prompts", "5", "--input-len", "6", "--output-len", "3",
                       "--max-concurrency", "2", "--vocab-size", "50")  # fmt: skip
    result = asyncio.run(run_benchmark(args, transport=httpx.MockTransport(handler)))
    assert (result["completed"], result["failed"]) == (5, 0)
    assert result["total_output_tokens"] == 15 and result["total_input_tokens"] == 30
    assert in_flight[1] <= 2
    assert all(b["model"] == "tiny" and b["stream"] and b["ignore_eos"] for b in bodies)
    assert all(len(b["prompt"]) == 6 and max(b["prompt"]) < 50 for b in bodies)
    assert result["p99_itl_ms"] >= result["median_itl_ms"] > 0
