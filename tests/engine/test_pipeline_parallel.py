"""Pipeline parallelism through the engine: two stages (two processes), each with half of the
layers, must give transformers' greedy tokens and logprobs (fp32) under chunked prefill,
preemption and prefix-cache hits, with two batches in flight on two virtual engines that each
write their own KV cache slice; a stage builds and loads only its layers; bad settings are
refused naming the setting; a dead stage fails the engine with an error naming it, in bounded
time. Gloo on CPU only: the NCCL path needs two GPUs and is untested.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import tokenwise.distributed.pp_state as pp_state
from tests.engine._fixtures import (
    assert_pool_clean,
    checkpoint,
    hf_greedy,
    hf_step_logprobs,
    mixed_prompts,
)
from tokenwise import LLM, SamplingParams
from tokenwise.distributed.pp_state import ENV_LAYER_PARTITION, pp_layer_partition
from tokenwise.distributed.tp_state import free_port

MAX_TOKENS = 6


def pp_checkpoint(arch: str) -> str:
    """Four layers (two per stage); Qwen3's with a tied LM head, which the last stage, lacking
    the embedding, must load from the embedding's tensor."""
    return checkpoint(arch, num_hidden_layers=4, tie_word_embeddings=arch == "Qwen3ForCausalLM")


def pp_llm(path: str, **kwargs: Any) -> LLM:
    return LLM(path, dtype="float32", pipeline_parallel_size=2, **kwargs)


def _record_in_flight(llm: LLM) -> list[int]:
    """Wrap the driver's `submit` to record how many batches were in flight after each one."""
    pipeline = llm.llm_engine.runner.pipeline
    submit, seen = pipeline.submit, []

    def recording(sched: Any, virtual_engine: int) -> None:
        submit(sched, virtual_engine)
        seen.append(pipeline.num_in_flight)

    pipeline.submit = recording
    return seen


# "windowed": a Qwen2 whose layers 1-3 slide (window 8): one stage holds a global and a
# sliding layer, the other two sliding ones, and both must see the driver's KV-cache groups.
# Qwen2-MoE: routed experts and a gated shared expert, each stage loading only its layers'.
@pytest.mark.parametrize(
    "arch", ["LlamaForCausalLM", "Qwen3ForCausalLM", "windowed", "Qwen2MoeForCausalLM"]
)
def test_pp2_gives_hf_tokens_on_two_virtual_engines(arch: str) -> None:
    path = (
        checkpoint(
            "Qwen2ForCausalLM",
            num_hidden_layers=4,
            use_sliding_window=True,
            sliding_window=8,
            max_window_layers=1,
        )
        if arch == "windowed"
        else pp_checkpoint(arch)
    )
    # 8 blocks of 16 tokens per virtual engine (one 128-token sequence) and 16-token chunks:
    # long prompts are prefilled in pieces beside decodes, and decodes preempt each other.
    llm = pp_llm(path, num_gpu_blocks=16, max_model_len=128, max_num_batched_tokens=16)
    try:
        engine = llm.llm_engine
        in_flight = _record_in_flight(llm)
        prompts = mixed_prompts()
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        _assert_each_virtual_engine_wrote_its_own_slice(engine)
        for prompt, out in zip(prompts, outputs, strict=True):
            assert out.outputs[0].token_ids == hf_greedy(path, prompt, MAX_TOKENS)
        longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
        ref = hf_step_logprobs(path, prompts[longest], MAX_TOKENS)
        for step, entry in enumerate(outputs[longest].outputs[0].logprobs):
            for tid, lp in entry.items():
                assert lp.logprob == pytest.approx(ref[step][tid].item(), abs=1e-4)
        stats = engine.get_stats()
        assert stats.num_preemptions_total > 0
        assert stats.prefix_cache_hits > 0
        # Both stages computed at once: two batches were in flight, and each stage was busy.
        assert max(in_flight) == 2
        assert all(busy > 0 for busy in engine.runner.pipeline.stage_busy_seconds())
        assert_pool_clean(engine)
        for manager in engine.block_manager.managers:
            manager.check_invariants()
    finally:
        llm.shutdown()
    assert not torch.distributed.is_initialized()


def _assert_each_virtual_engine_wrote_its_own_slice(engine: Any) -> None:
    """Fails if `virtual_engine` stayed 0: virtual engine 1's requests would then have written
    into slice 0 and slice 1 would hold only zeros. Each engine's pool handed out blocks, and
    exactly those blocks of its slice hold K/V."""
    for manager in engine.block_manager.managers:
        assert manager.prefix_cache_queries > 0  # requests were placed on every engine
    for layer in engine.runner.cache_layers().values():
        assert len(layer.kv_cache) == 2 and layer.kv_cache[0] is not layer.kv_cache[1]
        for cache in layer.kv_cache:  # virtual engine k's copy
            assert cache.abs().sum() > 0


def _build_stage(path: str, rank: int, monkeypatch: pytest.MonkeyPatch) -> torch.nn.Module:
    """Stage `rank` of 2 as its process builds and loads it, without the processes."""
    from tokenwise.entrypoints.llm import build_engine_config
    from tokenwise.loader import load_model

    monkeypatch.setattr(pp_state, "_pp_rank", rank)
    monkeypatch.setattr(pp_state, "_pp_size", 2)
    config = build_engine_config(path, dtype="float32", pipeline_parallel_size=2)
    return load_model(config)


@pytest.mark.parametrize("partition", [None, "3,1"])
def test_each_stage_builds_and_loads_only_its_layers(
    partition: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = pp_checkpoint("Qwen3ForCausalLM")  # tied: the last stage loads its own head
    if partition is not None:
        monkeypatch.setenv(ENV_LAYER_PARTITION, partition)
    first_layers = [0, 1] if partition is None else [0, 1, 2]
    stage0, stage1 = (_build_stage(path, rank, monkeypatch) for rank in (0, 1))
    names0 = {n for n, _ in stage0.named_parameters()}
    names1 = {n for n, _ in stage1.named_parameters()}
    layers0 = {int(n.split(".")[2]) for n in names0 if n.startswith("model.layers.")}
    layers1 = {int(n.split(".")[2]) for n in names1 if n.startswith("model.layers.")}
    assert sorted(layers0) == first_layers
    assert sorted(layers1) == [i for i in range(4) if i not in first_layers]
    assert "model.embed_tokens.weight" in names0 and "lm_head.weight" not in names0
    assert "model.norm.weight" not in names0
    assert "model.embed_tokens.weight" not in names1
    assert {"model.norm.weight", "lm_head.weight"} <= names1
    # Together the stages hold exactly the one-process model's parameters (the head once more:
    # the last stage owns a copy of the tied embedding) and the same values.
    monkeypatch.setattr(pp_state, "_pp_size", 1)
    monkeypatch.setattr(pp_state, "_pp_rank", 0)
    from tokenwise.entrypoints.llm import build_engine_config
    from tokenwise.loader import load_model

    whole = dict(load_model(build_engine_config(path, dtype="float32")).named_parameters())
    staged = {**dict(stage0.named_parameters()), **dict(stage1.named_parameters())}
    assert set(staged) == set(whole) | {"lm_head.weight"}
    for name, param in whole.items():
        assert torch.equal(staged[name], param), name
    assert torch.equal(staged["lm_head.weight"], whole["model.embed_tokens.weight"])


def test_layer_partition_follows_vllms_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_LAYER_PARTITION, raising=False)
    assert pp_layer_partition(4, 2) == [2, 2]
    assert pp_layer_partition(5, 2) == [3, 2]  # the remainder before the last stage
    assert pp_layer_partition(7, 3) == [2, 3, 2]
    assert pp_layer_partition(8, 3) == [3, 3, 2]
    monkeypatch.setenv(ENV_LAYER_PARTITION, "1,3")
    assert pp_layer_partition(4, 2) == [1, 3]


@pytest.fixture
def no_group_left() -> Iterator[None]:
    yield
    assert not torch.distributed.is_initialized()  # nothing half-built left behind


@pytest.mark.usefixtures("no_group_left")
def test_a_pool_too_small_per_virtual_engine_is_refused() -> None:
    # 32 blocks of 16 tokens hold one 512-token sequence, but each virtual engine gets 16.
    with pytest.raises(ValueError, match=r"num_gpu_blocks=32 gives each .* at least 64"):
        pp_llm(pp_checkpoint("LlamaForCausalLM"), num_gpu_blocks=32, max_model_len=512)


@pytest.mark.usefixtures("no_group_left")
def test_stages_that_split_the_layers_differently_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As when torchrun's machines set different partitions: here only the engine's process
    (stage 0) is patched to hold one layer, while stage 1 splits evenly (layers 2-3)."""
    monkeypatch.setattr(pp_state, "pp_layer_partition", lambda n, p: [1, 3])
    with pytest.raises(
        ValueError, match=rf"do not cover the layers in order.*{ENV_LAYER_PARTITION}"
    ):
        pp_llm(pp_checkpoint("LlamaForCausalLM"), num_gpu_blocks=64)


@pytest.mark.usefixtures("no_group_left")
@pytest.mark.parametrize(
    ("arch", "pp", "env", "match"),
    [
        ("LlamaForCausalLM", 5, None, r"pipeline_parallel_size \(5\) exceeds .*num_hidden_layers"),
        (
            "LlamaForCausalLM",
            2,
            "2,1",
            rf"{ENV_LAYER_PARTITION}='2,1' sums to 3 layers.*num_hidden_layers=4",
        ),
        ("LlamaForCausalLM", 2, "4", rf"{ENV_LAYER_PARTITION}='4' has 1 entries"),
        ("LlamaForCausalLM", 2, "4,0", "at least one layer"),
    ],
)
def test_bad_settings_are_refused_naming_the_setting(
    arch: str, pp: int, env: str | None, match: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if env is not None:
        monkeypatch.setenv(ENV_LAYER_PARTITION, env)
    with pytest.raises(ValueError, match=match):
        LLM(pp_checkpoint(arch), dtype="float32", pipeline_parallel_size=pp)


def test_pp2_x_tp2_uneven_partition_abort_in_flight_and_a_killed_stage(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Four processes (two stages of two TP ranks), stage 0 with three layers and stage 1 with
    one (`TOKENWISE_PP_LAYER_PARTITION=3,1`), give HF's tokens; an abort while its batch is in
    flight leaves the pool clean; killing a rank of stage 1 fails the next step with an error
    naming it, in bounded time."""
    monkeypatch.setenv(ENV_LAYER_PARTITION, "3,1")
    path = pp_checkpoint("LlamaForCausalLM")
    llm = pp_llm(path, num_gpu_blocks=64, tensor_parallel_size=2)
    try:
        engine = llm.llm_engine
        model = engine.runner.model
        assert (model.model.start_layer, model.model.end_layer) == (0, 3)
        names = {n for n, _ in model.named_parameters()}
        assert (
            "model.layers.3.self_attn.qkv_proj.weight" not in names
            and "lm_head.weight" not in names
        )
        # TP shards within the stage: half the MLP rows and half the vocabulary.
        hf_intermediate = json.loads(open(os.path.join(path, "config.json")).read())[
            "intermediate_size"
        ]
        assert model.model.layers[0].mlp.gate_up_proj.weight.shape[0] == hf_intermediate
        prompts = mixed_prompts()[:4]
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        for prompt, out in zip(prompts, outputs, strict=True):
            assert out.outputs[0].token_ids == hf_greedy(path, prompt, MAX_TOKENS)
        # Abort while the request's batch is in flight: it finishes once collected.
        engine.add_request("a", prompts[0], params)
        engine.add_request("b", prompts[1], params)
        engine.step()
        assert engine.runner.pipeline.num_in_flight == 1
        engine.abort_request("a")
        tokens: dict[str, list[int]] = {"a": [], "b": []}  # step outputs are deltas
        reasons = {}
        for _ in range(50):
            for out in engine.step():
                tokens[out.request_id] += out.outputs[0].token_ids
                reasons[out.request_id] = out.outputs[0].finish_reason
            if not engine.has_unfinished_requests():
                break
        assert reasons == {"a": "abort", "b": "length"}
        assert tokens["b"] == hf_greedy(path, prompts[1], MAX_TOKENS)
        assert_pool_clean(engine)
        stage1_tp1 = engine.runner.pipeline.channel.workers.procs[2]  # global rank 3
        os.kill(stage1_tp1.pid, signal.SIGKILL)
        stage1_tp1.join(timeout=5)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"pipeline stage 1 TP rank 1 \(pid \d+\) exited"):
            llm.generate(prompts[:2], params, use_tqdm=False)
        assert time.monotonic() - start < 20
    finally:
        llm.shutdown()
    assert not torch.distributed.is_initialized()


def test_bench_throughput_prints_each_stages_busy_fraction(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from tokenwise.entrypoints.cli import main

    out = tmp_path / "t.json"
    args = ["bench", "throughput", "--model", pp_checkpoint("LlamaForCausalLM"),
            "--dtype", "float32", "--num-prompts", "6", "--input-len", "12",
            "--output-len", "5", "--pipeline-parallel-size", "2", "--output-json", str(out)]  # fmt: skip
    assert main(args) == 0
    stdout = capsys.readouterr().out
    line = re.search(r"^Pipeline stages busy .*: stage 0 (\d+)%, stage 1 (\d+)%$", stdout, re.M)
    assert line is not None, stdout
    fractions = json.loads(out.read_text())["stage_busy_fraction"]
    assert len(fractions) == 2 and all(0 < f <= 1 for f in fractions)
    assert [int(p) for p in line.groups()] == [round(100 * f) for f in fractions]
    assert "Parallel (pipeline_parallel_size=2)" in stdout  # with its one-process baseline
    assert not torch.distributed.is_initialized()


def test_an_engine_core_process_runs_the_pipeline() -> None:
    """`tokenwise serve`'s engine-core process starts its stages too (it must not be a daemon,
    which may not start processes) and streams HF's tokens."""
    from tokenwise.engine.client import create_engine
    from tokenwise.entrypoints.llm import build_engine_config

    path = pp_checkpoint("LlamaForCausalLM")
    config = build_engine_config(path, dtype="float32", num_gpu_blocks=64, pipeline_parallel_size=2)
    core = create_engine(config, core_process=True)
    try:
        prompts = mixed_prompts()[:3]
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        tokens: dict[str, list[int]] = {}
        for i, prompt in enumerate(prompts):
            core.add_request(str(i), prompt, params)
            tokens[str(i)] = []
        deadline = time.monotonic() + 60
        while any(core.has_request(rid) for rid in tokens):
            assert time.monotonic() < deadline, "requests did not finish"
            for delta in core.step():
                tokens[delta.request_id] += delta.outputs[0].token_ids
        for i, prompt in enumerate(prompts):
            assert tokens[str(i)] == hf_greedy(path, prompt, MAX_TOKENS)
    finally:
        core.shutdown()


def test_torchrun_launch_generates_the_same_text() -> None:
    """Two torchrun processes (as on two machines, one stage each): rank 0 is the engine,
    rank 1 serves as stage 1 and exits with status 0 when rank 0 shuts down."""
    path = pp_checkpoint("LlamaForCausalLM")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    torchrun += ["--master-port", str(free_port()), "-m", "tokenwise.entrypoints.cli"]
    args = ["generate", "--model", path, "--dtype", "float32", "--max-tokens", "8",
            "--temperature", "0", "--ignore-eos", "--pipeline-parallel-size", "2",
            "Hello world"]  # fmt: skip
    launched = subprocess.run(
        [*torchrun, *args],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
    )
    assert launched.returncode == 0, launched.stderr[-3000:]
    one = LLM(path, dtype="float32")  # the same text from one process (its detokenizer too)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = one.generate("Hello world", params, use_tqdm=False)[0].outputs[0].text
    assert "Hello world" + expected in launched.stdout
    assert launched.stdout.count("--- prompt:") == 1  # only rank 0 prints: one engine
