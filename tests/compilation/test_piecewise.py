"""Piecewise compilation: the graph is cut at every attention call, the pieces in between are
compiled, and the result equals the eager model. One Dynamo compilation serves every token
count, a single token included (no 0/1 specialisation).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.tiny_checkpoints import build_tiny_checkpoint
from tokenwise import LLM, SamplingParams
from tokenwise.config import CompilationConfig, CUDAGraphMode
from tokenwise.entrypoints.llm import build_engine_config

PROMPTS = ["The quick brown fox", "Hello", "def fibonacci(n):\n    return", "import os\nimport"]
# Different lengths, so the decode batch shrinks 4 -> 3 -> 2 -> 1 as requests finish.
PARAMS = [
    SamplingParams(temperature=0, max_tokens=2 + 2 * i, ignore_eos=True, logprobs=2)
    for i in range(4)
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), "Qwen3ForCausalLM")


def piecewise_llm(path: str, piece_backend: str, splitting_ops: list[str] | None = None) -> LLM:
    config = build_engine_config(path, dtype="float32", num_gpu_blocks=64, enforce_eager=True)
    config.compilation.use_compile = True
    config.compilation.piecewise_compile = True
    config.compilation.piece_backend = piece_backend
    if splitting_ops is not None:
        config.compilation.splitting_ops = splitting_ops
    return LLM.from_engine_config(config)


def generate(llm: LLM) -> tuple[list[list[int]], list[list[float]], list[int]]:
    """Tokens, each step's chosen-token logprob, and the token count of every forward pass."""
    runner = llm.llm_engine.runner
    execute, counts = runner.execute_model, []

    def counting(scheduled: Any) -> Any:
        out = execute(scheduled)
        counts.append(out.num_tokens)
        return out

    runner.execute_model = counting
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [
        [
            step[t].logprob
            for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)
        ]
        for o in outs
    ]
    return tokens, logprobs, counts


def test_piecewise_inductor_matches_eager_and_compiles_once(checkpoint: str) -> None:
    torch._dynamo.reset()
    eager_tokens, eager_lp, _ = generate(
        LLM(checkpoint, dtype="float32", num_gpu_blocks=64, enforce_eager=True)
    )
    llm = piecewise_llm(checkpoint, "inductor")
    tokens, logprobs, counts = generate(llm)
    assert tokens == eager_tokens
    for got, want in zip(logprobs, eager_lp, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert 1 in counts and len(set(counts)) >= 4  # a prefill, then 4, 3, 2 and 1 decodes
    backend = llm.llm_engine.runner.model.backend
    assert backend.num_compiles == 1

    num_layers = llm.llm_engine.model_config.num_layers
    pieces = backend.pieces
    assert len(pieces) == 2 * num_layers + 1
    assert [p.is_splitting_op for p in pieces] == [False, True] * num_layers + [False]
    for piece in pieces:
        calls = [n for n in piece.graph.graph.nodes if "unified_attention" in str(n.target)]
        assert len(calls) == (1 if piece.is_splitting_op else 0)


def test_moe_model_is_cut_at_the_expert_op_too(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The expert op reads per-expert token counts on the host, so, like attention, it must sit
    between pieces (never inside a piece a CUDA graph would capture)."""
    path = build_tiny_checkpoint(tmp_path_factory.mktemp("moe"), "Qwen3MoeForCausalLM")
    torch._dynamo.reset()
    eager_tokens, eager_lp, _ = generate(
        LLM(path, dtype="float32", num_gpu_blocks=64, enforce_eager=True)
    )
    llm = piecewise_llm(path, "eager")
    tokens, logprobs, _ = generate(llm)
    assert tokens == eager_tokens
    for got, want in zip(logprobs, eager_lp, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    pieces = llm.llm_engine.runner.model.backend.pieces
    ops = [
        str(n.target)
        for p in pieces
        if p.is_splitting_op
        for n in p.graph.graph.nodes
        if n.op == "call_function"
    ]
    num_layers = llm.llm_engine.model_config.num_layers
    assert sum("unified_attention" in op for op in ops) == num_layers
    assert sum("moe_experts" in op for op in ops) == num_layers  # every layer is sparse here
    for piece in pieces:
        if not piece.is_splitting_op:
            assert not any("moe_experts" in str(n.target) for n in piece.graph.graph.nodes)


def test_without_splitting_ops_the_graph_stays_whole(checkpoint: str) -> None:
    torch._dynamo.reset()
    llm = piecewise_llm(checkpoint, "eager", splitting_ops=[])
    generate(llm)
    pieces = llm.llm_engine.runner.model.backend.pieces
    assert len(pieces) == 1 and not pieces[0].is_splitting_op


def test_piecewise_is_chosen_by_the_graph_mode_unless_forced() -> None:
    M = CUDAGraphMode
    assert CompilationConfig(cudagraph_mode=M.PIECEWISE).use_piecewise_compile
    assert CompilationConfig(cudagraph_mode=M.FULL_AND_PIECEWISE).use_piecewise_compile
    assert not CompilationConfig(cudagraph_mode=M.FULL_DECODE_ONLY).use_piecewise_compile
    assert not CompilationConfig(cudagraph_mode=M.NONE).use_piecewise_compile
    assert CompilationConfig(piecewise_compile=True).use_piecewise_compile
    assert not CompilationConfig(
        cudagraph_mode=M.PIECEWISE, piecewise_compile=False
    ).use_piecewise_compile
    with pytest.raises(ValueError, match="piece_backend must be one of inductor, eager"):
        CompilationConfig(piece_backend="aot_eager")


def test_many_compiled_engines_in_one_process_never_hit_the_recompile_limit(
    checkpoint: str,
) -> None:
    """Each engine's model keeps its own Dynamo cache, so the limit never counts other engines.

    With one shared `forward` code object every new model failed the earlier models' guards and
    recompiled into the same cache: under a limit of 2 the third engine raised (on a GPU the
    eighth did, at Dynamo's default limit). The engines here stay alive, the worst case.
    """
    engines, first_tokens = [], None
    with torch._dynamo.config.patch(recompile_limit=2, accumulated_recompile_limit=64):
        for _ in range(3):
            llm = piecewise_llm(checkpoint, "eager")
            tokens, _, _ = generate(llm)
            first_tokens = first_tokens or tokens
            assert tokens == first_tokens
            engines.append(llm)


def test_piecewise_split_without_tuple_returns(
    checkpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch releases before `split_module(tuple_return=...)` (the GPU image's 2.11) split too."""
    from tokenwise.compilation import piecewise

    expected, _, _ = generate(piecewise_llm(checkpoint, "eager"))
    monkeypatch.setattr(piecewise, "_SPLIT_KWARGS", {})
    llm = piecewise_llm(checkpoint, "inductor")
    assert generate(llm)[0] == expected
    assert llm.llm_engine.runner.model.backend.num_compiles == 1
