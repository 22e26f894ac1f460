"""Pipeline parallelism beyond the Llama family: Gemma 3 (no residual stream between layers: one
tensor per hand-over), Gemma 4 with per-layer inputs and KV sharing, DeepSeek-V3 (latent
attention, grouped MoE routing) and gpt-oss (sinks, alternating windows) run as two stages
(two processes) and give transformers' greedy tokens and logprobs (fp32) under chunked
prefill, with two batches in flight; each stage of every family builds and loads exactly its
share of the parameters (in-process); splits Gemma 4 cannot run and the Gated DeltaNet hybrids
are refused by name before any stage starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import tokenwise.distributed.pp_state as pp_state
from tests.engine._fixtures import checkpoint, hf_greedy, hf_step_logprobs, mixed_prompts
from tests.engine.test_pipeline_parallel import _record_in_flight
from tests.models.test_gemma4_vs_hf import SHAPES
from tests.tiny_checkpoints import build_tiny_checkpoint
from tokenwise import LLM, SamplingParams
from tokenwise.distributed.pp_state import ENV_LAYER_PARTITION

MAX_TOKENS = 5
_TYPES = ["sliding_attention", "full_attention"] * 4
# Gemma 4 shaped like its E2B/E4B models (per-layer inputs, the last two layers reading layers
# 4 and 5's KV cache with double-width MLPs), 8 layers alternating sliding and global so that
# "4,4" gives both stages both kinds of KV cache and keeps every sharing pair on one stage.
GEMMA4_E = {**SHAPES["e"], "num_hidden_layers": 8, "layer_types": _TYPES}
# Gated DeltaNet hybrids with two runs of three linear-attention layers and a full-attention
# one, so that "4,4" gives each stage both kinds.
HYBRID_8 = {
    "num_hidden_layers": 8,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 2,
}
# name -> (architecture, checkpoint overrides, TOKENWISE_PP_LAYER_PARTITION)
FAMILIES: dict[str, tuple[str, dict[str, Any], str | None]] = {
    "gemma2": ("Gemma2ForCausalLM", {}, None),
    "gemma3": ("Gemma3ForCausalLM", {}, None),
    "gemma4-e": ("Gemma4ForCausalLM", GEMMA4_E, "4,4"),
    "deepseek-v2": ("DeepseekV2ForCausalLM", {}, None),
    "deepseek-v3": ("DeepseekV3ForCausalLM", {}, None),
    "gpt-oss": ("GptOssForCausalLM", {}, None),
    "qwen3-next": ("Qwen3NextForCausalLM", HYBRID_8, None),
    "qwen3.5": ("Qwen3_5ForCausalLM", HYBRID_8, None),
}
# One engine run per family (Gemma 2 and DeepSeek-V2 share their stage code with Gemma 3 and
# DeepSeek-V3; Qwen3-Next its hybrid stack with Qwen3.5).
ENGINE_RUNS = ["gemma3", "gemma4-e", "deepseek-v3", "gpt-oss", "qwen3.5"]


def _path(family: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    arch, overrides, partition = FAMILIES[family]
    if partition is None:
        monkeypatch.delenv(ENV_LAYER_PARTITION, raising=False)
    else:
        monkeypatch.setenv(ENV_LAYER_PARTITION, partition)
    return build_tiny_checkpoint(tmp_path, arch, **overrides)


@pytest.mark.parametrize("family", ENGINE_RUNS)
def test_pp2_gives_hf_tokens_and_logprobs(
    family: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = _path(family, monkeypatch, tmp_path)
    # 16-token chunks: the longer prompts are prefilled in pieces, past the 8-token windows.
    llm = LLM(
        path,
        dtype="float32",
        pipeline_parallel_size=2,
        num_gpu_blocks=32,
        max_model_len=128,
        max_num_batched_tokens=16,
    )
    try:
        engine = llm.llm_engine
        in_flight = _record_in_flight(llm)
        stage0 = engine.runner.model.model
        assert stage0.is_first_stage and not stage0.is_last_stage
        assert 0 < stage0.end_layer < len(stage0.layers)
        prompts = [mixed_prompts()[i] for i in (3, 5, 15, 17)]  # 35, 16, 95 and 7 tokens
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        for prompt, out in zip(prompts, outputs, strict=True):
            assert out.outputs[0].token_ids == hf_greedy(path, prompt, MAX_TOKENS)
        ref = hf_step_logprobs(path, prompts[2], MAX_TOKENS)
        for step, entry in enumerate(outputs[2].outputs[0].logprobs):
            for tid, lp in entry.items():
                # The Gated DeltaNet kernels differ from transformers' by 1e-4..3e-4 at PP=1
                # too (chunked vs recurrent delta rule; the GDN tests compare tokens).
                tol = 5e-4 if family == "qwen3.5" else 1e-4
                assert lp.logprob == pytest.approx(ref[step][tid].item(), abs=tol)
        assert max(in_flight) == 2
    finally:
        llm.shutdown()
    assert not torch.distributed.is_initialized()


def _load(path: str, rank: int, size: int, monkeypatch: pytest.MonkeyPatch) -> torch.nn.Module:
    """Stage `rank` of `size` as its process builds and loads it, without the processes."""
    from tokenwise.entrypoints.llm import build_engine_config
    from tokenwise.loader import load_model

    monkeypatch.setattr(pp_state, "_pp_rank", rank)
    monkeypatch.setattr(pp_state, "_pp_size", size)
    return load_model(build_engine_config(path, dtype="float32"))


@pytest.mark.parametrize("family", FAMILIES)
def test_each_stage_loads_exactly_its_share(
    family: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The two stages' parameters are the one-process model's, split at the stage boundary
    (a tied head once more: the last stage owns a copy of the embedding), with its values."""
    path = _path(family, monkeypatch, tmp_path)
    whole = dict(_load(path, 0, 1, monkeypatch).named_parameters())
    stages = [_load(path, rank, 2, monkeypatch) for rank in (0, 1)]
    params = [dict(stage.named_parameters()) for stage in stages]
    end = stages[0].model.end_layer
    assert stages[1].model.start_layer == end
    for rank, names in enumerate(params):
        layers = {int(n.split(".")[2]) for n in names if n.startswith("model.layers.")}
        assert layers == set(range(end) if rank == 0 else range(end, len(stages[1].model.layers)))
    assert "model.embed_tokens.weight" in params[0] and "lm_head.weight" not in params[0]
    assert "model.norm.weight" in params[1] and "model.embed_tokens.weight" not in params[1]
    staged = {**params[0], **params[1]}
    tied = "lm_head.weight" not in whole
    assert set(staged) == set(whole) | ({"lm_head.weight"} if tied else set())
    for name, param in whole.items():
        assert torch.equal(staged[name], param), name
    if tied:
        assert torch.equal(staged["lm_head.weight"], whole["model.embed_tokens.weight"])


@pytest.mark.parametrize(
    ("family", "partition", "match"),
    [
        (
            "gemma4-e",
            "5,3",
            r"puts Gemma 4 layer 6 on stage 1 but layer 4, whose KV cache it reads "
            r"\(num_kv_shared_layers=2\), on stage 0: set TOKENWISE_PP_LAYER_PARTITION",
        ),
        (
            "gemma4-e",
            "3,5",
            r"splits the layers \[3, 5\], which gives the stages different kinds of KV cache "
            r".*\[\['2x16', '2x32'\], \['2x32', '2x16'\]\]",
        ),
        (
            "qwen3.5",
            "2,6",
            r"splits the layers \[2, 6\], which gives stage 0 only linear_attention layers",
        ),
    ],
)
def test_splits_the_model_cannot_run_are_refused_before_any_stage_starts(
    family: str, partition: str | None, match: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = _path(family, monkeypatch, tmp_path)
    if partition is not None:
        monkeypatch.setenv(ENV_LAYER_PARTITION, partition)
    with pytest.raises(ValueError, match=match):
        LLM(path, dtype="float32", pipeline_parallel_size=2)
    assert not torch.distributed.is_initialized()


def test_a_model_outside_the_pipeline_families_is_refused_naming_it() -> None:
    path = checkpoint("BertModel", num_hidden_layers=4)
    with pytest.raises(
        ValueError, match=r"pipeline_parallel_size=2 is not supported for BertModel"
    ):
        LLM(path, dtype="float32", task="embed", pipeline_parallel_size=2)
    assert not torch.distributed.is_initialized()


def test_a_hybrid_split_that_leaves_a_stage_one_kind_of_layer_is_refused() -> None:
    """Qwen3-Next / Qwen3.5: every stage must hold linear- and full-attention layers (one set
    of KV-cache groups serves all stages)."""
    from types import SimpleNamespace

    from tokenwise.models.qwen3_next import Qwen3NextForCausalLM

    hf = SimpleNamespace(layer_types=HYBRID_8["layer_types"])
    Qwen3NextForCausalLM.check_pipeline_split(hf, [4, 4])
    Qwen3NextForCausalLM.check_pipeline_split(hf, [5, 3])
    with pytest.raises(
        ValueError,
        match=r"splits the layers \[2, 6\], which gives stage 0 only linear_attention layers: "
        r"every stage of a Gated DeltaNet hybrid must hold both",
    ):
        Qwen3NextForCausalLM.check_pipeline_split(hf, [2, 6])
