"""DeepSeek-V2 / V3 (multi-head latent attention + DeepSeek MoE) against transformers.

Logits are compared position by position on one sequence outside the engine, for each
variant of the architecture (q through `q_proj` or through the `q_lora_rank` bottleneck,
greedy or group-limited routing, V3's biased sigmoid routing, both RoPE layouts). Then greedy
tokens through `tokenwise.LLM` against HF `generate`, with prompts longer than the step's token
budget (chunked prefill), shared prefixes (prefix-cache hits) and a pool small enough to
preempt; afterwards every KV block is free. The cache test checks that MLA caches
`kv_lora_rank + qk_rope_head_dim` elements per token and layer, and that the log says so.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.engine._fixtures import assert_pool_clean, checkpoint, hf_greedy, mixed_prompts
from tests.tiny_checkpoints import build_tiny_checkpoint
from tokenwise import LLM, SamplingParams
from tokenwise.config import EngineConfig
from tokenwise.distributed import tp_state
from tokenwise.loader import load_model
from tokenwise.model_config import ModelConfig
from tokenwise.models.deepseek_moe import DeepseekMoE

V2, V3 = "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"
SEQ_LEN = 24
# Group-limited routing changes a choice only when a token takes more experts than the two
# best groups' two best: 3 of 8 experts in 4 groups, the best 2 groups kept.
GROUPED = {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2,
           "num_experts_per_tok": 3}  # fmt: skip

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 16}  # fmt: skip

# name -> (arch, config overrides)
LOGIT_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "v2-q-proj": (V2, {}),
    "v2-q-lora": (V2, {"q_lora_rank": 24}),
    "v2-grouped-topk": (V2, GROUPED),
    "v2-one-shared-attention-bias": (V2, {"n_shared_experts": 1, "attention_bias": True}),
    "v3": (V3, {}),
    "v3-q-lora-rope-halves": (V3, {"q_lora_rank": 24, "rope_interleave": False}),
    # YaRN as DeepSeek ships it: scaled frequencies, cos/sin scaled by mscale / mscale_all_dim
    # and the softmax scale by mscale_all_dim^2; and without mscales (0.1 ln(factor) + 1).
    "v2-yarn-mscale": (V2, {"rope_parameters": {**YARN, "mscale": 1.0, "mscale_all_dim": 0.8}}),
    "v3-yarn": (V3, {"rope_parameters": YARN}),
}


def _load(path: str) -> torch.nn.Module:
    return load_model(EngineConfig(model=ModelConfig.from_pretrained(path, dtype="float32")))


def _input_ids() -> torch.Tensor:
    return torch.randint(2, 300, (SEQ_LEN,), generator=torch.Generator().manual_seed(0))


def _hf_logits(path: str, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(ids[None]).logits[0].float()


@pytest.mark.parametrize("case", list(LOGIT_CASES))
def test_logits_match_hf(tmp_path: Path, case: str) -> None:
    arch, overrides = LOGIT_CASES[case]
    path = build_tiny_checkpoint(tmp_path, arch, **overrides)
    model = _load(path)
    kinds = [
        "moe" if isinstance(layer.mlp, DeepseekMoE) else "dense" for layer in model.model.layers
    ]
    assert kinds == ["dense", "moe", "moe"]  # first_k_dense_replace=1
    ids = _input_ids()
    ours = model.compute_logits(model(ids, torch.arange(SEQ_LEN)))
    torch.testing.assert_close(ours, _hf_logits(path, ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", [V2, V3])
def test_bf16_logits_round_where_hf_rounds(arch: str) -> None:
    """In bf16 the rounding points matter: V2 rotates in float32 (V3 in bf16), routers score
    in float32, experts are scaled by float32 weights. HF bf16 is ~1.3 away from HF fp32 here;
    matching its rounding brings us within a few bf16 ulps of it (bit-equal on the dev box)."""
    from transformers import AutoModelForCausalLM

    path = checkpoint(arch)
    config = ModelConfig.from_pretrained(path, dtype="bfloat16")
    model = load_model(EngineConfig(model=config))
    ids = _input_ids()
    ours = model.compute_logits(model(ids, torch.arange(SEQ_LEN))).float()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        want = hf(ids[None]).logits[0].float()
    torch.testing.assert_close(ours, want, atol=0.05, rtol=0)


def test_stacked_expert_checkpoint_loads_identically(tmp_path: Path) -> None:
    """transformers 5's in-memory form (experts stacked) gives the same parameters."""
    from transformers import AutoModelForCausalLM

    per_expert = build_tiny_checkpoint(tmp_path, V3)
    stacked = tmp_path / "stacked"
    stacked.mkdir()
    for name in os.listdir(per_expert):
        if name != "model.safetensors":
            (stacked / name).write_bytes(Path(per_expert, name).read_bytes())
    hf = AutoModelForCausalLM.from_pretrained(per_expert, dtype=torch.float32)
    tensors = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in tensors
    save_file(tensors, str(stacked / "model.safetensors"), metadata={"format": "pt"})
    a, b = _load(per_expert).state_dict(), _load(str(stacked)).state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.1.mlp.gate.e_score_correction_bias",
        "model.layers.2.self_attn.kv_b_proj.weight",
        "model.layers.1.mlp.shared_experts.up_proj.weight",
    ],
)
def test_missing_tensor_is_named(tmp_path: Path, name: str) -> None:
    path = build_tiny_checkpoint(tmp_path, V3)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    del tensors[name]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing") as info:
        _load(path)
    assert name in str(info.value)


def test_tp_size_that_does_not_divide_the_heads_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """MLA shards whole heads (tests/engine/test_mla_tensor_parallel.py runs TP=2): 4 heads
    cannot be split 3 ways, and the error says which count and which size."""
    monkeypatch.setattr(tp_state, "_tp_size", 3)
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\).*tensor_parallel_size \(3\)"):
        _load(checkpoint(V2))


def test_moe_under_tp_all_reduces_routed_and_shared_experts_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Both expert outputs are TP-partial sums over the same tokens: one all-reduce adds them
    (two would double the collective traffic of every MoE layer). Rank 0 of 2, faked here; the
    sums themselves are checked against HF by tests/engine/test_mla_tensor_parallel.py."""
    calls: list[tuple[int, ...]] = []
    monkeypatch.setattr(tp_state, "_tp_size", 2)
    monkeypatch.setattr(tp_state, "_tp_group", object())
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda x, group: calls.append(x.shape))
    config = EngineConfig(model=ModelConfig.from_pretrained(checkpoint(V3), dtype="float32"))
    hf = config.model.hf_config
    moe = DeepseekMoE(config, "model.layers.1.mlp", is_v3=True)
    assert moe.shared_experts is not None
    shared_width = hf.n_shared_experts * hf.moe_intermediate_size // 2
    assert moe.shared_experts.down_proj.weight.shape == (hf.hidden_size, shared_width)
    for param in moe.parameters():
        param.data.normal_(generator=torch.Generator().manual_seed(1))
    moe(torch.randn(5, hf.hidden_size))
    assert calls == [(5, hf.hidden_size)]


def test_bad_grouping_is_refused_by_name(tmp_path: Path) -> None:
    path = build_tiny_checkpoint(tmp_path, V2, **GROUPED)
    config = ModelConfig.from_pretrained(path, dtype="float32")
    config.hf_config.topk_group = 5
    with pytest.raises(ValueError, match=r"topk_group must be in \[1, n_group=4\], got 5"):
        load_model(EngineConfig(model=config))


# ------------------------------------------------------------------- through the engine

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

# name -> (arch, config overrides, engine arguments)
ENGINE_CASES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "v2-q-lora-prefix-cache": (V2, {"q_lora_rank": 24}, {}),
    "v2-grouped-chunked-8": (V2, GROUPED, {"max_num_batched_tokens": 8}),
    "v3-preempt-chunked-16": (
        V3,
        {},
        {"num_gpu_blocks": 12, "max_model_len": 192, "max_num_batched_tokens": 16},
    ),
}


@pytest.mark.parametrize("case", list(ENGINE_CASES))
def test_greedy_tokens_match_hf_generate(case: str) -> None:
    """All 18 prompts (1-95 tokens: block boundaries, a duplicate, four sharing a 40-token
    prefix) through the engine: HF's greedy tokens, then every block free."""
    arch, overrides, engine_args = ENGINE_CASES[case]
    path = checkpoint(arch, **overrides)
    prompts = mixed_prompts()
    refs = [hf_greedy(path, p, MAX_TOKENS) for p in prompts]
    llm = LLM(path, dtype="float32", seed=0, **{"num_gpu_blocks": 256, **engine_args})
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out, want in zip(prompts, outputs, refs, strict=True):
        assert list(out.outputs[0].token_ids) == want, f"prompt of {len(prompt)} tokens"
    # Shared prefixes and the duplicate prompt were served from the prefix cache.
    assert sum(out.num_cached_tokens for out in outputs) > 0
    if "num_gpu_blocks" in engine_args:
        assert llm.llm_engine.scheduler.num_preemptions > 0, "the small pool should preempt"
    assert_pool_clean(llm.llm_engine)


def test_cache_holds_the_latent_only_and_the_log_says_so(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tokenwise")
    hf = ModelConfig.from_pretrained(checkpoint(V2), dtype="float32").hf_config
    latent = hf.kv_lora_rank + hf.qk_rope_head_dim  # 32 + 8
    full_kv = 2 * hf.num_attention_heads * (hf.qk_nope_head_dim + hf.qk_rope_head_dim)
    assert latent == 40 and full_kv == 192
    llm = LLM(checkpoint(V2), dtype="float32", num_gpu_blocks=40)
    runner = llm.llm_engine.runner
    assert len(runner.kv_caches) == hf.num_hidden_layers
    for cache in runner.kv_caches.values():
        assert cache.shape == (40 + 1, 16, latent)  # one trash block, 16 tokens a block
    assert runner.kv_sizer.kv_cache_bytes_per_block() == hf.num_hidden_layers * 16 * latent * 4
    report = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:")]
    assert len(report) == 1
    assert "MLA latent: 40 elements (160 bytes) per token per layer x 3 layers" in report[0]
