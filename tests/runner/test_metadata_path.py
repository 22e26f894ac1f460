"""The engine's attention metadata comes from `CommonMetadataBuilder` (forward-context.md §3).

A stub `build` that raises must make `LLM.generate` fail with the stub's own error (the
engine fails the step's requests with it): if the runner built metadata any other way,
generation would succeed. A spy then checks that the
metadata the attention layers receive is the very object `build` returned.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.engine._fixtures import checkpoint
from tokenwise import LLM, SamplingParams
from tokenwise.attention.backends.torch_backend import TorchAttentionImpl
from tokenwise.attention.metadata import AttentionMetadata, CommonMetadataBuilder
from tokenwise.entrypoints.llm import build_engine_config

PARAMS = SamplingParams(temperature=0.0, max_tokens=3)


def _llm() -> LLM:
    config = build_engine_config(
        checkpoint("LlamaForCausalLM"), dtype="float32", num_gpu_blocks=32, enforce_eager=True
    )
    return LLM.from_engine_config(config)


def test_generate_fails_with_a_raising_builder(monkeypatch: pytest.MonkeyPatch) -> None:
    llm = _llm()

    def refuse(self: CommonMetadataBuilder, *args: Any, **kwargs: Any) -> AttentionMetadata:
        raise RuntimeError("stub builder: the engine asked CommonMetadataBuilder.build")

    monkeypatch.setattr(CommonMetadataBuilder, "build", refuse)
    # The engine keeps serving after a failed step: the step's requests fail with its error.
    (out,) = llm.generate(["The quick brown fox"], PARAMS, use_tqdm=False)
    assert out.error == "RuntimeError: stub builder: the engine asked CommonMetadataBuilder.build"
    assert out.outputs[0].finish_reason == "error" and out.outputs[0].token_ids == []


def test_attention_reads_the_builders_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    llm = _llm()
    built: list[AttentionMetadata] = []
    seen: list[AttentionMetadata] = []
    build, forward = CommonMetadataBuilder.build, TorchAttentionImpl.forward

    def spy_build(self: CommonMetadataBuilder, *args: Any, **kwargs: Any) -> AttentionMetadata:
        built.append(build(self, *args, **kwargs))
        return built[-1]

    def spy_forward(self: TorchAttentionImpl, *args: Any, **kwargs: Any) -> Any:
        md = args[4] if len(args) > 4 else kwargs["attn_metadata"]
        seen.append(md)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(CommonMetadataBuilder, "build", spy_build)
    monkeypatch.setattr(TorchAttentionImpl, "forward", spy_forward)
    outs = llm.generate(["The quick brown fox", "Hello"], PARAMS, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 3 for o in outs)
    # One build per step (one attention spec), every attention call on a built object.
    assert len(built) == 3
    assert seen and {id(md) for md in seen} == {id(md) for md in built}
