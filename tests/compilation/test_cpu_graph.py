"""CPU graphs: decode steps replayed from recorded C kernel calls (`compilation/cpu_graph.py`).

What must hold: a replayed step computes exactly what the eager step computes (the same
kernels, on the same inputs: tokens and logprobs bit for bit), on whatever the persistent input
buffers hold at replay time; a forward that runs any torch op besides views and allocations is
refused at capture (that batch size then runs eagerly, with the op named in the log); a kernel
call that bypasses the recording is caught by the capture's own check replay; and a kernel
failing during replay is an error naming it.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import pytest
import torch

from tests.engine._fixtures import LLAMA, assert_pool_clean, checkpoint, hf_greedy, mixed_prompts
from tokenwise import LLM, SamplingParams
from tokenwise.compilation.cpu_graph import CPUGraphCapturer, GraphCaptureRejected
from tokenwise.config import CUDAGraphMode
from tokenwise.entrypoints.engine_args import build_engine_config
from tokenwise.native import fused as cpu_fused
from tokenwise.native import graph as native_graph
from tokenwise.native import trace as native_trace

pytestmark = pytest.mark.skipif(
    native_graph.load() is None or cpu_fused.load() is None, reason="no C compiler"
)

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)


def outputs(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[Any]]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [
        (list(o.outputs[0].token_ids), [sorted(d.items()) for d in o.outputs[0].logprobs])
        for o in outs
    ]


def count_graph_steps(llm: LLM) -> list[int]:
    """A list that grows by the padded size of every step that replays a FULL graph."""
    runner = llm.llm_engine.runner
    execute, replayed = runner.execute_model, []

    def counting(sched: Any) -> Any:
        out = execute(sched)
        mode, desc = runner.last_graph
        if mode == CUDAGraphMode.FULL:
            replayed.append(desc.num_tokens)
        return out

    runner.execute_model = counting
    return replayed


@pytest.mark.parametrize(
    "arch, dtype, quantization, sizes",
    [
        (LLAMA, "float32", None, [1, 2, 4, 8]),
        (LLAMA, "bfloat16", None, [1, 2]),  # bf16 dense: the C linear kernel takes 2 rows at most
        (LLAMA, "bfloat16", "int4", [1, 2, 4, 8]),
        (LLAMA, "float32", "int8", [1, 2, 4, 8]),
        (LLAMA, "bfloat16", "fp8", [1, 2, 4, 8]),
        ("Qwen3ForCausalLM", "float32", "int4", [1, 2, 4, 8]),  # per-head q/k norms, strided
    ],
)
def test_replayed_decode_steps_equal_eager_ones_bit_for_bit(
    arch: str, dtype: str, quantization: str | None, sizes: list[int]
) -> None:
    path = checkpoint(arch)
    prompts = [p for p in mixed_prompts() if 3 <= len(p) <= 40][:5]
    common: dict[str, Any] = dict(dtype=dtype, quantization=quantization, num_gpu_blocks=64)
    common |= dict(max_num_seqs=8, max_model_len=128)
    eager = LLM(path, enforce_eager=True, **common)
    assert eager.llm_engine.runner.graph_runner is None
    graphs = LLM(path, **common)  # CPU graphs are the default on CPU
    runner = graphs.llm_engine.runner
    assert graphs.llm_engine.config.compilation.cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY
    captured = sorted(k.num_tokens for k in runner.graph_runner.dispatcher.keys[CUDAGraphMode.FULL])
    assert captured == sizes
    replayed = count_graph_steps(graphs)
    for n in (1, 3, 5):  # padded to 1, 4 and 8 (bf16: 3 and 5 run eagerly)
        want = outputs(eager, prompts[:n])
        assert outputs(graphs, prompts[:n]) == want
        if dtype == "float32" and quantization is None and arch == LLAMA:
            assert [t for t, _ in want] == [hf_greedy(path, p, MAX_TOKENS) for p in prompts[:n]]
    assert 1 in replayed and (8 in replayed) == (8 in sizes)
    assert_pool_clean(graphs.llm_engine)


def test_graphs_under_preemption_prefix_hits_and_chunked_prefill() -> None:
    """A pool too small for all sequences (preemptions), shared prefixes (cache hits) and
    small chunks: replays read whatever block tables, lengths and slots the step wrote."""
    path = checkpoint(LLAMA)
    prompts = [p for p in mixed_prompts() if 20 <= len(p) <= 60][:6]
    common: dict[str, Any] = dict(dtype="float32", num_gpu_blocks=14, max_num_seqs=6)
    common |= dict(max_num_batched_tokens=16, max_model_len=128)
    graphs = LLM(path, **common)
    replayed = count_graph_steps(graphs)
    got = outputs(graphs, prompts + prompts[:2])
    assert [t for t, _ in got] == [hf_greedy(path, p, MAX_TOKENS) for p in prompts + prompts[:2]]
    assert got == outputs(LLM(path, enforce_eager=True, **common), prompts + prompts[:2])
    stats = graphs.llm_engine.get_stats()
    assert stats.num_preemptions_total > 0 and stats.prefix_cache_hits > 0
    assert replayed
    assert_pool_clean(graphs.llm_engine)


def test_a_torch_op_in_the_forward_refuses_the_capture(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """With the activation's C kernel declined, the MLP runs torch's silu: no size can be
    replayed, the log names the op, and the engine decodes eagerly with HF's tokens."""
    monkeypatch.setattr(cpu_fused, "silu_and_mul", lambda x: None)
    path = checkpoint(LLAMA)
    with caplog.at_level(logging.INFO, logger="tokenwise.runner.graph_runner"):
        llm = LLM(path, dtype="float32", num_gpu_blocks=64, max_num_seqs=4)
    graph_runner = llm.llm_engine.runner.graph_runner
    assert not graph_runner.dispatcher.keys[CUDAGraphMode.FULL]
    assert sorted(k.num_tokens for k in graph_runner.rejected) == [1, 2, 4]
    assert all("aten.silu" in reason for reason in graph_runner.rejected.values())
    assert "aten.silu" in caplog.text
    replayed = count_graph_steps(llm)
    prompts = [p for p in mixed_prompts() if 3 <= len(p) <= 40][:2]
    assert [t for t, _ in outputs(llm, prompts)] == [
        hf_greedy(path, p, MAX_TOKENS) for p in prompts
    ]
    assert not replayed


def test_a_kernel_call_around_the_recording_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel called without `native.trace` is missing from the recording: the capture's
    check replay (temporaries filled with a sentinel first) does not reproduce the output."""
    call = native_trace.call

    def bypass_activation(lib: ctypes.CDLL, name: str, *args: Any) -> Any:
        return getattr(lib, name)(*args) if name == "tw_act_mul" else call(lib, name, *args)

    monkeypatch.setattr(native_trace, "call", bypass_activation)
    llm = LLM(checkpoint(LLAMA), dtype="float32", num_gpu_blocks=64, max_num_seqs=2)
    rejected = llm.llm_engine.runner.graph_runner.rejected
    assert sorted(k.num_tokens for k in rejected) == [1, 2]
    assert all("did not reproduce" in reason for reason in rejected.values())


def test_replay_reads_the_inputs_in_place_and_rewrites_its_outputs() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 64)
    weight = torch.randn(64)
    capturer = CPUGraphCapturer()

    def forward() -> torch.Tensor:
        normed, _ = cpu_fused.rms_norm(x, weight, 1e-6)
        return cpu_fused.silu_and_mul(normed)

    out = capturer.capture(forward)
    assert len(capturer.calls) == 2 and capturer.num_replays == 1  # the check replay
    for _ in range(2):
        x.copy_(torch.randn(3, 64))
        capturer.replay()
        normed, _ = cpu_fused.rms_norm(x, weight, 1e-6)
        assert torch.equal(out, cpu_fused.silu_and_mul(normed))


def test_capture_without_any_kernel_or_with_a_host_read_is_refused() -> None:
    x = torch.randn(4)
    with pytest.raises(GraphCaptureRejected, match="no C kernel"):
        CPUGraphCapturer().capture(lambda: x.view(2, 2))
    with pytest.raises(GraphCaptureRejected, match="_local_scalar_dense"):
        CPUGraphCapturer().capture(lambda: cpu_fused.silu_and_mul(x.view(1, 4) * float(x[0])))


def test_a_kernel_failing_during_replay_is_named() -> None:
    lib = cpu_fused.load()
    x, out = torch.randn(1, 8), torch.empty(1, 4)

    def forward() -> torch.Tensor:  # activation 7 does not exist: the kernel returns -1
        native_trace.call(lib, "tw_act_mul", x.data_ptr(), out.data_ptr(), 1, 4, 7, 0)
        return out

    with pytest.raises(RuntimeError, match=r"kernel 'tw_act_mul' \(call 1 of 1\) failed"):
        CPUGraphCapturer().capture(forward)


def test_graph_modes_on_cpu_are_checked_by_name() -> None:
    path = checkpoint(LLAMA)
    assert build_engine_config(path).compilation.cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY
    eager = build_engine_config(path, enforce_eager=True)
    assert eager.compilation.cudagraph_mode == CUDAGraphMode.NONE
    none = build_engine_config(path, cudagraph_mode="NONE")
    assert none.compilation.cudagraph_mode == CUDAGraphMode.NONE
    full = build_engine_config(path, cudagraph_mode="full")
    assert full.compilation.cudagraph_mode == CUDAGraphMode.FULL
    with pytest.raises(ValueError, match="cudagraph_mode=PIECEWISE replays compiled pieces"):
        build_engine_config(path, cudagraph_mode="PIECEWISE")
    with pytest.raises(ValueError, match="cannot be combined with enforce_eager"):
        build_engine_config(path, cudagraph_mode="FULL_DECODE_ONLY", enforce_eager=True)
    moe = build_engine_config(checkpoint("MixtralForCausalLM"))
    assert moe.compilation.cudagraph_mode == CUDAGraphMode.NONE  # experts run torch ops
