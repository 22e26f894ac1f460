"""Mixtral, Qwen2-MoE and Qwen3-MoE against Hugging Face transformers on tiny checkpoints.

Logits are compared position by position on one sequence outside the engine (as in
test_models_vs_hf.py), then greedy tokens through `tokenwise.LLM` against HF `generate`, also
under chunked prefill and preemption. Loading is checked in both checkpoint forms (per-expert
tensors and transformers 5's stacked tensors), for missing tensors, and per DP rank.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.engine._fixtures import assert_pool_clean, checkpoint, hf_greedy, mixed_prompts
from tests.tiny_checkpoints import build_tiny_checkpoint
from tokenwise import LLM, SamplingParams
from tokenwise.config import EngineConfig, ParallelConfig
from tokenwise.layers.fused_moe import FusedMoE
from tokenwise.loader import load_model
from tokenwise.model_config import ModelConfig
from tokenwise.models import MODEL_REGISTRY
from tokenwise.models.llama import LlamaMLP

SEQ_LEN = 20
MOE_ARCHS = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")


def _input_ids() -> torch.Tensor:
    return torch.randint(2, 300, (SEQ_LEN,), generator=torch.Generator().manual_seed(0))


def _load(path: str, parallel: ParallelConfig | None = None) -> torch.nn.Module:
    model_config = ModelConfig.from_pretrained(path, dtype="float32")
    return load_model(EngineConfig(model=model_config, parallel=parallel or ParallelConfig()))


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model.compute_logits(model(ids, torch.arange(ids.numel())))


def _hf_logits(path: str, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(ids[None]).logits[0].float()


def _block_kinds(model: torch.nn.Module) -> list[str]:
    return ["dense" if isinstance(layer.mlp, LlamaMLP) else "moe" for layer in model.model.layers]


# name -> (arch, config overrides, expected dense/moe layout)
LOGIT_CASES: dict[str, tuple[str, dict[str, Any], list[str]]] = {
    "mixtral": ("MixtralForCausalLM", {}, ["moe", "moe"]),
    "mixtral-window6": ("MixtralForCausalLM", {"sliding_window": 6}, ["moe", "moe"]),
    "qwen2-moe": ("Qwen2MoeForCausalLM", {}, ["moe", "moe"]),
    "qwen2-moe-sparse-step-2": (
        "Qwen2MoeForCausalLM",
        {"num_hidden_layers": 3, "decoder_sparse_step": 2},
        ["dense", "moe", "dense"],
    ),
    "qwen2-moe-norm-topk": ("Qwen2MoeForCausalLM", {"norm_topk_prob": True}, ["moe", "moe"]),
    "qwen2-moe-no-qkv-bias": ("Qwen2MoeForCausalLM", {"qkv_bias": False}, ["moe", "moe"]),
    "qwen3-moe": ("Qwen3MoeForCausalLM", {}, ["moe", "moe"]),
    "qwen3-moe-mlp-only-0": ("Qwen3MoeForCausalLM", {"mlp_only_layers": [0]}, ["dense", "moe"]),
    "qwen3-moe-no-norm-topk": ("Qwen3MoeForCausalLM", {"norm_topk_prob": False}, ["moe", "moe"]),
}


@pytest.mark.parametrize("case", list(LOGIT_CASES))
def test_logits_match_hf(tmp_path: Path, case: str) -> None:
    arch, overrides, layout = LOGIT_CASES[case]
    path = build_tiny_checkpoint(tmp_path, arch, **overrides)
    model = _load(path)
    assert _block_kinds(model) == layout
    ids = _input_ids()
    ours = _logits(model, ids)
    assert ours.shape == (SEQ_LEN, 300)
    torch.testing.assert_close(ours, _hf_logits(path, ids), atol=1e-4, rtol=0)


def test_mixtral_window_changes_only_positions_past_it(tmp_path: Path) -> None:
    """Guards the windowed case above: matching HF there means the window is applied."""
    ids = _input_ids()
    full = _logits(_load(build_tiny_checkpoint(tmp_path, "MixtralForCausalLM")), ids)
    windowed = _logits(
        _load(build_tiny_checkpoint(tmp_path, "MixtralForCausalLM", sliding_window=6)), ids
    )
    torch.testing.assert_close(windowed[:6], full[:6], atol=1e-5, rtol=0)
    assert (windowed[6:] - full[6:]).abs().amax(dim=-1).min() > 1e-3


def test_only_moe_models_are_marked_moe() -> None:
    moe = (*MOE_ARCHS, "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "GptOssForCausalLM")
    moe += ("Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
    for arch, cls in MODEL_REGISTRY.items():
        assert getattr(cls, "is_moe", False) == (arch in moe), arch


def _hf_state_dict_checkpoint(src: str, dst: Path) -> str:
    """The same weights, saved in transformers 5's in-memory (stacked-experts) form."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    dst.mkdir()
    for name in os.listdir(src):
        if name != "model.safetensors":
            (dst / name).write_bytes(Path(src, name).read_bytes())
    tensors = {k: v.contiguous() for k, v in hf.state_dict().items()}
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


@pytest.mark.parametrize("arch", ["MixtralForCausalLM", "Qwen2MoeForCausalLM"])
def test_stacked_checkpoint_loads_identically(tmp_path: Path, arch: str) -> None:
    per_expert = build_tiny_checkpoint(tmp_path, arch)
    stacked = _hf_state_dict_checkpoint(per_expert, tmp_path / "stacked")
    names = set(load_file(os.path.join(stacked, "model.safetensors")))
    assert "model.layers.0.mlp.experts.gate_up_proj" in names  # really the stacked form
    a, b = _load(per_expert).state_dict(), _load(stacked).state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _drop(path: str, *names: str) -> None:
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    for name in names:
        del tensors[name]
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("arch", "name"),
    [
        ("MixtralForCausalLM", "model.layers.1.block_sparse_moe.experts.2.w3.weight"),
        ("MixtralForCausalLM", "model.layers.0.block_sparse_moe.gate.weight"),
        ("Qwen2MoeForCausalLM", "model.layers.1.mlp.experts.7.down_proj.weight"),
        ("Qwen2MoeForCausalLM", "model.layers.0.mlp.shared_expert.up_proj.weight"),
        ("Qwen2MoeForCausalLM", "model.layers.0.mlp.shared_expert_gate.weight"),
    ],
)
def test_missing_tensor_is_named_as_in_the_checkpoint(tmp_path: Path, arch: str, name: str) -> None:
    path = build_tiny_checkpoint(tmp_path, arch)
    _drop(path, name)
    with pytest.raises(ValueError, match="missing") as info:
        _load(path)
    assert name in str(info.value)


@pytest.mark.parametrize("ep", [True, False], ids=["expert-parallel", "intermediate-sharded"])
def test_dp_ranks_load_only_their_share(tmp_path: Path, ep: bool) -> None:
    path = build_tiny_checkpoint(tmp_path, "Qwen3MoeForCausalLM")
    full = _load(path)
    ranks = [
        _load(
            path,
            ParallelConfig(data_parallel_size=2, data_parallel_rank=r, enable_expert_parallel=ep),
        )
        for r in (0, 1)
    ]
    for name, module in full.named_modules():
        if not isinstance(module, FusedMoE):
            continue
        shards = [dict(r.named_modules())[name] for r in ranks]
        assert shards[0].w13_weight.numel() * 2 == module.w13_weight.numel()
        if ep:  # whole experts, split over ranks
            w13 = torch.cat([s.w13_weight for s in shards])
            w2 = torch.cat([s.w2_weight for s in shards])
        else:  # gate rows, up rows and down columns of every expert, split over ranks
            gates, ups = zip(*(s.w13_weight.chunk(2, dim=1) for s in shards), strict=True)
            w13 = torch.cat([*gates, *ups], dim=1)
            w2 = torch.cat([s.w2_weight for s in shards], dim=2)
        assert torch.equal(w13, module.w13_weight) and torch.equal(w2, module.w2_weight)
    # Each rank computes only a share of the experts: without the DP exchange it refuses.
    with pytest.raises(RuntimeError, match="forward context"):
        ranks[0](_input_ids(), torch.arange(SEQ_LEN))


def test_a_rank_needs_only_its_own_experts(tmp_path: Path) -> None:
    path = build_tiny_checkpoint(tmp_path, "MixtralForCausalLM")  # 4 experts: rank 1 has 2, 3
    _drop(
        path, *(f"model.layers.0.block_sparse_moe.experts.0.{w}.weight" for w in ("w1", "w2", "w3"))
    )
    rank1 = ParallelConfig(data_parallel_size=2, data_parallel_rank=1, enable_expert_parallel=True)
    _load(path, rank1)
    rank0 = ParallelConfig(data_parallel_size=2, data_parallel_rank=0, enable_expert_parallel=True)
    with pytest.raises(ValueError, match=r"layers\.0\.block_sparse_moe\.experts\.0\.w1\.weight"):
        _load(path, rank0)


# ------------------------------------------------------------------- through the engine

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
ARCH_PROMPTS = [0, 1, 3, 4, 6, 9, 12, 13, 15]  # indexes into mixed_prompts(): 1..95 tokens


def _engine_tokens(path: str, prompts: list[list[int]], **kwargs: Any) -> tuple[Any, list[Any]]:
    llm = LLM(path, dtype="float32", seed=0, **{"num_gpu_blocks": 256, **kwargs})
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_pool_clean(llm.llm_engine)
    return llm, [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_greedy_tokens_match_hf_generate(arch: str) -> None:
    path = checkpoint(arch)
    prompts = [mixed_prompts()[i] for i in ARCH_PROMPTS]
    refs = [hf_greedy(path, p, MAX_TOKENS) for p in prompts]
    _, got = _engine_tokens(path, prompts)
    for i, (tokens, want) in enumerate(zip(got, refs, strict=True)):
        assert tokens == want, f"{arch}: prompt of {len(prompts[i])} tokens"


@pytest.mark.parametrize(
    "schedule",
    [
        {"max_num_batched_tokens": 8},
        {"num_gpu_blocks": 12, "max_model_len": 192, "max_num_batched_tokens": 16},
    ],
    ids=["chunked-8", "preempt-chunked-16"],
)
def test_qwen2_moe_greedy_under_chunking_and_preemption(schedule: dict[str, Any]) -> None:
    """All 18 prompts (shared prefixes, block boundaries) with a dense layer in the middle."""
    path = checkpoint("Qwen2MoeForCausalLM", num_hidden_layers=3, decoder_sparse_step=2)
    prompts = mixed_prompts()
    refs = [hf_greedy(path, p, MAX_TOKENS) for p in prompts]
    llm, got = _engine_tokens(path, prompts, **schedule)
    assert got == refs
    if "num_gpu_blocks" in schedule:
        assert llm.llm_engine.scheduler.num_preemptions > 0, "the small pool should preempt"
