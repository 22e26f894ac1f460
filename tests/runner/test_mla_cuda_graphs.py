"""DeepSeek-V2 (MLA) under CUDA-graph dispatch, on CPU, with capture and replay faked.

As in test_graph_runner.py, `EagerReplayCapturer` replays by calling the captured function
again on the same persistent buffers, so stale metadata or a host-side value frozen at capture
would give other tokens than eager. Whole-step (FULL) decode graphs run MLA's absorbed decode
over the graph buffers' block tables and lengths; piecewise graphs must be cut at
`tokenwise::mla_attention`, whose prefill reads host lengths.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.engine._fixtures import assert_pool_clean, checkpoint
from tests.runner.test_graph_runner import (  # noqa: F401
    Recorder,
    assert_same_outputs,
    fake_graphs,
    graph_llm,
)
from tokenwise import LLM, SamplingParams
from tokenwise.config import CompilationConfig, CUDAGraphMode
from tokenwise.entrypoints.llm import build_engine_config

M = CUDAGraphMode
PROMPTS = ["The quick brown fox", "Hello", "def fibonacci(n):\n    return", "Once upon a time"]
# The decode batch shrinks 4, 3, 2, 1 as requests finish.
PARAMS = [
    SamplingParams(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True, logprobs=1)
    for i in range(len(PROMPTS))
]


def run(mode: CUDAGraphMode | None, recorder: Recorder | None = None) -> tuple[LLM, list[Any]]:
    config = build_engine_config(
        checkpoint("DeepseekV2ForCausalLM", q_lora_rank=24),
        dtype="float32",
        num_gpu_blocks=64,
        enforce_eager=True,
        max_num_batched_tokens=8,
    )
    llm = graph_llm(config, mode, [2, 4, 8], recorder)
    outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert_pool_clean(llm.llm_engine)
    return llm, outputs


def test_mla_attention_is_a_splitting_op() -> None:
    assert "tokenwise::mla_attention" in CompilationConfig().splitting_ops


@pytest.mark.parametrize("mode", [M.FULL_DECODE_ONLY, M.FULL_AND_PIECEWISE])
def test_graph_steps_give_eager_tokens(fake_graphs: Recorder, mode: CUDAGraphMode) -> None:  # noqa: F811
    eager_llm, eager = run(None)
    llm, outs = run(mode, fake_graphs)
    assert_same_outputs(outs, eager)
    modes = {m for *_, m, _ in fake_graphs.steps}
    assert M.FULL in modes and fake_graphs.replays > 0
    if mode == M.FULL_AND_PIECEWISE:
        assert M.PIECEWISE in modes
    # Padding rows wrote only to the trash block: every real block holds what eager wrote.
    for name, cache in llm.llm_engine.runner.kv_caches.items():
        eager_cache = eager_llm.llm_engine.runner.kv_caches[name]
        torch.testing.assert_close(cache[:-1], eager_cache[:-1], atol=1e-5, rtol=0)
