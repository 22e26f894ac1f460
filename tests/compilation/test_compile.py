"""The compiled model is the eager model: same greedy tokens and logprobs on a tiny model."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_checkpoints import build_tiny_checkpoint
from tokenwise import LLM, SamplingParams

PROMPTS = ["The quick brown fox", "Hello", "def fibonacci(n):\n    return", "import os\nimport"]


@pytest.fixture(scope="module", params=["Qwen3ForCausalLM", "LlamaForCausalLM"])
def checkpoint(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> str:
    """Qwen3 reshapes q/k per head before rotary; Llama rotates the flat [T, H*D] rows."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), request.param)


def _run(path: str, enforce_eager: bool) -> tuple[list[list[int]], list[float]]:
    llm = LLM(path, dtype="float32", num_gpu_blocks=64, enforce_eager=enforce_eager)
    runner = llm.llm_engine.runner
    assert runner.config.compilation.use_compile is (not enforce_eager)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    first_lp = [next(iter(o.outputs[0].logprobs[0].values())).logprob for o in outs]
    return tokens, first_lp


def test_compiled_matches_eager(checkpoint: str) -> None:
    torch._dynamo.reset()
    eager_tokens, eager_lp = _run(checkpoint, enforce_eager=True)
    compiled_tokens, compiled_lp = _run(checkpoint, enforce_eager=False)
    assert compiled_tokens == eager_tokens
    torch.testing.assert_close(compiled_lp, eager_lp, atol=1e-4, rtol=0)


def test_compiled_model_is_one_graph_with_opaque_attention(checkpoint: str) -> None:
    """Dynamo sees one graph per model with exactly one attention op per layer (no breaks)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    llm = LLM(checkpoint, dtype="float32", num_gpu_blocks=64)
    runner = llm.llm_engine.runner
    counter = CompileCounterWithBackend("eager")
    runner.model = torch.compile(runner.model, backend=counter, dynamic=True, fullgraph=True)
    llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert counter.frame_count >= 1
    graph = counter.graphs[0]
    attn_calls = [n for n in graph.graph.nodes if "unified_attention" in str(n.target)]
    num_layers = llm.llm_engine.model_config.num_layers
    assert len(attn_calls) == num_layers
