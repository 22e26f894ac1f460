"""Tensor parallelism through the engine: a driver and a spawned worker, each with half of every
layer, must give transformers' greedy tokens and logprobs (fp32, 1e-4) under chunked prefill
and preemption; a launch through `torchrun` must generate the same text; a dead worker must
fail the engine with an error naming it, in bounded time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
import torch

from tests.engine._fixtures import checkpoint, hf_greedy, hf_step_logprobs, mixed_prompts
from tests.tiny_checkpoints import build_tiny_checkpoint
from tokenwise import LLM, SamplingParams
from tokenwise.distributed.tp_state import free_port

MAX_TOKENS = 6
ARCHS = ["LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM"]


def tp_llm(path: str, **kwargs: Any) -> LLM:
    return LLM(path, dtype="float32", tensor_parallel_size=2, **kwargs)


@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_gives_hf_tokens_and_logprobs_under_chunking_and_preemption(arch: str) -> None:
    path = checkpoint(arch)
    # One 128-token sequence of KV per rank and 16-token chunks: long prompts are prefilled
    # in pieces beside decodes, and decodes that need a block preempt others.
    llm = tp_llm(path, num_gpu_blocks=8, max_model_len=128, max_num_batched_tokens=16)
    try:
        _assert_driver_holds_half(llm, path)
        prompts = mixed_prompts()
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        for prompt, out in zip(prompts, outputs, strict=True):
            completion = out.outputs[0]
            assert completion.token_ids == hf_greedy(path, prompt, MAX_TOKENS)
        # Logprobs of the longest prompt: the logits were gathered from both vocab shards.
        longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
        ref = hf_step_logprobs(path, prompts[longest], MAX_TOKENS)
        completion = outputs[longest].outputs[0]
        assert len(completion.logprobs) == MAX_TOKENS
        for step, entry in enumerate(completion.logprobs):
            for tid, lp in entry.items():
                assert lp.logprob == pytest.approx(ref[step][tid].item(), abs=1e-4)
        stats = llm.llm_engine.get_stats()
        assert stats.num_preemptions_total > 0
        assert stats.num_free_blocks == stats.num_total_blocks
    finally:
        llm.shutdown()


def _assert_driver_holds_half(llm: LLM, path: str) -> None:
    """The driver's layers are really shards: half the heads, columns and vocabulary rows."""
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(path)
    model = llm.llm_engine.runner.model
    attn = model.model.layers[0].self_attn
    head_dim = attn.head_dim
    kv = max(1, hf.num_key_value_heads // 2)
    assert attn.qkv_proj.weight.shape[0] == (hf.num_attention_heads // 2 + 2 * kv) * head_dim
    assert attn.o_proj.weight.shape[1] == hf.num_attention_heads * head_dim // 2
    assert model.model.embed_tokens.weight.shape[0] == -(-hf.vocab_size // 2)
    layer = llm.llm_engine.runner.attn_layers[next(iter(llm.llm_engine.runner.attn_layers))]
    assert layer.num_heads == hf.num_attention_heads // 2  # KV cache sized for its heads


def test_killed_worker_fails_the_engine_with_a_clear_error() -> None:
    llm = tp_llm(checkpoint("LlamaForCausalLM"))
    try:
        worker = llm.llm_engine.runner.tp.workers.procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(timeout=5)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"tensor-parallel worker 1 \(pid \d+\) exited"):
            llm.generate(mixed_prompts()[:3], SamplingParams(max_tokens=4), use_tqdm=False)
        assert time.monotonic() - start < 20
    finally:
        llm.shutdown()


def test_worker_killed_mid_run_is_named_too() -> None:
    """Killed while the driver is inside a collective: gloo fails the wait, and the error still
    names the worker rather than the socket."""
    llm = tp_llm(checkpoint("LlamaForCausalLM"))
    engine = llm.llm_engine
    worker = engine.runner.tp.workers.procs[0]
    execute = engine.runner.execute_model
    calls = 0

    def kill_on_third_step(sched: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 3:
            os.kill(worker.pid, signal.SIGKILL)
            time.sleep(0.2)
        return execute(sched)

    engine.runner.execute_model = kill_on_third_step
    try:
        with pytest.raises(RuntimeError, match=r"tensor-parallel worker 1 \(pid \d+\) exited"):
            llm.generate(mixed_prompts()[:3], SamplingParams(max_tokens=8), use_tqdm=False)
    finally:
        llm.shutdown()


def test_torchrun_launch_generates_the_same_text(tmp_path: Any) -> None:
    path = build_tiny_checkpoint(tmp_path, "Qwen3ForCausalLM")
    args = [
        "generate",
        "--model",
        path,
        "--dtype",
        "float32",
        "--max-tokens",
        "8",
        "--temperature",
        "0",
        "--ignore-eos",
        "Hello world",
    ]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    torchrun += ["--master-port", str(free_port()), "-m", "tokenwise.entrypoints.cli"]
    launched = subprocess.run(
        [*torchrun, *args, "--tensor-parallel-size", "2"],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
    )
    assert launched.returncode == 0, launched.stderr[-3000:]
    llm = LLM(path, dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = llm.generate("Hello world", params, use_tqdm=False)[0].outputs[0].text
    assert "Hello world" + expected in launched.stdout
    assert launched.stdout.count("--- prompt:") == 1  # only rank 0 prints: one engine


def test_unsupported_layouts_are_refused() -> None:
    # 4 attention heads cannot be split 3 ways: the error names the counts.
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(checkpoint("LlamaForCausalLM"), dtype="float32", tensor_parallel_size=3)
    assert torch.distributed.is_initialized() is False  # nothing half-built left behind
