"""The `tokenwise` command as a user runs it: a subprocess, its stdout, stderr and exit code."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.tiny_checkpoints import build_tiny_checkpoint

TIMEOUT = 180


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return subprocess.run(
        [sys.executable, "-m", "tokenwise.entrypoints.cli", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=env,
        input=stdin if stdin is not None else "",
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("cli"), "LlamaForCausalLM")


def _completion(stdout: str, prompt: str) -> str:
    """The text printed after `prompt` under its `--- prompt: ...` header line."""
    header = stdout.index(f"--- prompt: {prompt!r}")
    body = stdout[stdout.index("\n", header) + 1 :]
    assert body.startswith(prompt)
    rest = body[len(prompt) :]
    end = rest.find("\n--- ")
    return rest if end < 0 else rest[:end]


def test_generate_prints_the_greedy_completion(model_dir: str) -> None:
    from tokenwise import LLM, SamplingParams

    prompt = "The quick brown fox"
    proc = run_cli(
        "generate",
        prompt,
        "--model",
        model_dir,
        "--max-tokens",
        "8",
        "--dtype",
        "float32",
        "--ignore-eos",
        "--kv-cache-memory",
        "8MiB",
    )
    assert proc.returncode == 0, proc.stderr
    expected = (
        LLM(model_dir, dtype="float32", kv_cache_memory=1 << 23)
        .generate(
            prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
        )[0]
        .outputs[0]
        .text
    )
    assert _completion(proc.stdout, prompt).rstrip("\n") == expected.rstrip("\n")
    assert "tokens/s" in proc.stderr  # the throughput line


def test_stream_prints_the_same_text(model_dir: str) -> None:
    common = [
        "--model",
        model_dir,
        "--max-tokens",
        "10",
        "--dtype",
        "float32",
        "--ignore-eos",
        "--kv-cache-memory",
        "8MiB",
    ]
    plain = run_cli("generate", "Hello", "def fibonacci(n):", *common)
    streamed = run_cli("generate", "Hello", "def fibonacci(n):", "--stream", *common)
    assert plain.returncode == 0 and streamed.returncode == 0, streamed.stderr
    for prompt in ("Hello", "def fibonacci(n):"):
        assert (
            _completion(streamed.stdout, prompt).strip()
            == _completion(plain.stdout, prompt).strip()
        )


def test_seed_makes_sampling_reproducible_and_n_prints_every_sample(model_dir: str) -> None:
    args = [
        "generate",
        "Once upon a time",
        "--model",
        model_dir,
        "--max-tokens",
        "12",
        "--temperature",
        "1.0",
        "--dtype",
        "float32",
        "--kv-cache-memory",
        "8MiB",
        "--ignore-eos",
        "--n",
        "2",
    ]
    first = run_cli(*args, "--seed", "7")
    second = run_cli(*args, "--seed", "7")
    other = run_cli(*args, "--seed", "8")
    assert first.returncode == 0, first.stderr
    assert all(f"(sample {i})" in first.stdout for i in range(2))
    assert first.stdout == second.stdout
    assert other.stdout != first.stdout


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["generate", "hi", "--model", "/nonexistent/model"], "does not exist"),
        (["generate", "hi", "--max-tokens", "0"], "max_tokens"),
        (["generate", "hi", "--temperature", "-1"], "temperature"),
        (["generate", "hi", "--top-p", "1.5"], "top_p"),
        (["generate", "hi", "--max-num-seqs", "zero"], "max-num-seqs"),
        (["generate", "hi", "--kv-cache-memory", "lots"], "kv-cache-memory"),
        (["generate", "hi", "--dtype", "int3"], "dtype"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_input_is_one_line_without_traceback(
    model_dir: str, args: list[str], needle: str
) -> None:
    if "--model" not in args and args[0] == "generate":
        args = [*args, "--model", model_dir]
    proc = run_cli(*args)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert needle in proc.stderr
    error_lines = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(error_lines) == 1, proc.stderr


def test_help_documents_every_flag() -> None:
    proc = run_cli("generate", "--help")
    assert proc.returncode == 0
    for flag in (
        "--model",
        "--max-tokens",
        "--temperature",
        "--top-p",
        "--seed",
        "--n",
        "--stream",
        "--dtype",
        "--max-model-len",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--kv-cache-memory",
        "--load-format",
        "--enforce-eager",
    ):
        assert flag in proc.stdout


def test_chat_without_template_continues_plain_text(model_dir: str) -> None:
    # The tiny tokenizer has a chat template; remove it to exercise plain continuation.
    import json

    from tokenwise import LLM, SamplingParams

    cfg_path = os.path.join(model_dir, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.pop("chat_template", None)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    for extra in ("chat_template.jinja", "chat_template.json"):
        if os.path.exists(os.path.join(model_dir, extra)):
            os.remove(os.path.join(model_dir, extra))
    proc = run_cli(
        "chat",
        "--model",
        model_dir,
        "--max-tokens",
        "6",
        "--dtype",
        "float32",
        "--ignore-eos",
        "--kv-cache-memory",
        "8MiB",
        stdin="Hello\n/exit\n",
    )
    assert proc.returncode == 0, proc.stderr
    expected = (
        LLM(model_dir, dtype="float32", kv_cache_memory=1 << 23)
        .generate(
            "Hello", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False
        )[0]
        .outputs[0]
        .text
    )
    assert proc.stdout.strip() == ("Hello" + expected).strip()
    assert "plain continuation" in proc.stderr
