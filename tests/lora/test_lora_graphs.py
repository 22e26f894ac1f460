"""LoRA batches get their own CUDA graphs (`has_lora` in the batch descriptor), on CPU with
capture and replay faked (see tests/runner/test_graph_runner.py for the fake).

A LoRA engine captures every key twice: base-model graphs without the adapters' matmuls and
`has_lora` graphs with them. Steps that use an adapter must replay the latter (a base graph
would silently drop the adapter), base-only steps the former, and tokens equal eager LoRA runs.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.lora.test_lora_vs_peft import GREEDY, _prompts, _tokens, checkpoint, request
from tests.runner.test_graph_runner import Recorder, fake_graphs  # noqa: F401
from tokenwise import LLM
from tokenwise.config import CUDAGraphMode
from tokenwise.entrypoints.llm import build_engine_config

ARCH = "Qwen3ForCausalLM"


def _run(mode: CUDAGraphMode | None, recorder: Recorder | None = None) -> tuple[LLM, Any]:
    config = build_engine_config(
        checkpoint(ARCH),
        dtype="float32",
        num_gpu_blocks=64,
        enforce_eager=True,
        max_num_batched_tokens=8,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
    )
    if mode is not None:
        config.compilation.cudagraph_mode = mode
        config.compilation.cudagraph_capture_sizes = [4, 8]
        config.compilation.use_compile = True
        config.compilation.piece_backend = "eager"
    llm = LLM.from_engine_config(config)
    if recorder is not None:
        recorder.spy(llm)
    prompts = _prompts()[:3]
    # First the adapters' requests with one base request, then base requests alone.
    first = [(p, n) for p in prompts for n in ("all-r8", "attn-r4")] + [(prompts[0], None)]
    outs: list[Any] = []
    for batch in (first, [(p, None) for p in prompts]):
        loras = [None if n is None else request(ARCH, n) for _, n in batch]
        outs += llm.generate([p for p, _ in batch], GREEDY, use_tqdm=False, lora_request=loras)
    return llm, _tokens(outs)


def test_steps_with_adapters_replay_lora_graphs(fake_graphs: Recorder) -> None:  # noqa: F811
    _, eager = _run(None)
    torch._dynamo.reset()
    llm, got = _run(CUDAGraphMode.FULL_AND_PIECEWISE, fake_graphs)
    assert got == eager
    # Two full decode graphs and one graph per compiled piece per size, for base and LoRA.
    num_layers = llm.llm_engine.model_config.num_layers
    assert len(fake_graphs.capturers) == 2 * (2 + 2 * (num_layers + 1))
    lora_steps = [s for s in fake_graphs.steps if s[3].has_lora]
    base_steps = [s for s in fake_graphs.steps if not s[3].has_lora]
    assert lora_steps and base_steps
    assert {s[2] for s in lora_steps} == {CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE}
    assert CUDAGraphMode.FULL in {s[2] for s in base_steps}
