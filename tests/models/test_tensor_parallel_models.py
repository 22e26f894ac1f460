"""Tensor-parallel models over two real gloo ranks, against Hugging Face and the checkpoint.

Both ranks build each tiny model with `load_model` inside a TP group of two and run one prompt
as one uncached sequence (no forward context): the all-reduced / all-gathered logits must be
HF's (fp32, 1e-4) on *both* ranks, and every parameter a rank holds must be exactly the slice
of the checkpoint tensor it should be (derived here from the head / vocab layout, not from the
layers' own code). The cases cover GQA with KV heads split (Llama with q/k/v/o and MLP biases,
Qwen3), KV heads replicated (Qwen3 with one KV head, plus a vocabulary of odd size, tied to
the LM head), an MoE model with a shared expert (Qwen2-MoE), and every other family (Qwen2,
Mistral, Mixtral, Qwen3-MoE), and DeepSeek-V2 / V3 (multi-head latent attention: per-head
projections split, the latent projections and the cached latent whole on each rank).

Single-process tests below check that nothing distributed runs with one rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from tests.distributed._spawn import run_ranks
from tests.models import _tp_worker as worker
from tests.tiny_checkpoints import build_tiny_checkpoint, tiny_config
from tokenwise.config import EngineConfig
from tokenwise.loader import load_model
from tokenwise.model_config import ModelConfig

TP = worker.TP_SIZE
DEADLINE_S = 120.0
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-biases": ("LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True}),
    "qwen3": ("Qwen3ForCausalLM", {}),
    # 4 query heads, 1 KV head: each rank holds 2 query heads and a copy of the KV head; 301
    # vocabulary rows split 151 + 150 (+1 zero padding row), shared with the LM head.
    "qwen3-kv1-odd-vocab-tied": (
        "Qwen3ForCausalLM",
        {"num_key_value_heads": 1, "vocab_size": 301, "tie_word_embeddings": True},
    ),
    "qwen2-moe-shared": ("Qwen2MoeForCausalLM", {}),
    # Every other family of the project: QKV biases (Qwen2), Mistral, and the other two MoEs.
    "qwen2": ("Qwen2ForCausalLM", {}),
    "mistral": ("MistralForCausalLM", {}),
    "mixtral": ("MixtralForCausalLM", {}),
    "qwen3-moe": ("Qwen3MoeForCausalLM", {}),
    # Alternating windows, soft-caps, GeGLU, four norms per layer, tied embeddings (+ q/k norms
    # and two RoPE tables in Gemma 3).
    "gemma2": ("Gemma2ForCausalLM", {}),
    "gemma3": ("Gemma3ForCausalLM", {}),
    # Latent attention: heads split, the latent path replicated; V3 through q_lora_rank.
    "deepseek-v2": ("DeepseekV2ForCausalLM", {}),
    "deepseek-v3-q-lora": ("DeepseekV3ForCausalLM", {"q_lora_rank": 24}),
}
# Mixtral's checkpoint names its MoE block differently (`block_sparse_moe`, `w1/w2/w3`): its
# shards are checked through the logits only.
NAMES_AS_IN_CHECKPOINT = set(CASES) - {"mixtral"}


def _run_two_ranks(cases: dict[str, str]) -> dict[int, dict[str, Any]]:
    return run_ranks(worker.run_rank, TP, cases, deadline_s=DEADLINE_S)


def _hf_logits(path: str, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(ids[None]).logits[0].float()


def _rows(start: int, size: int) -> slice:
    return slice(start, start + size)


def expected_shard(
    name: str, ckpt: dict[str, torch.Tensor], hf: Any, rank: int, tp: int
) -> torch.Tensor:
    """The part of the checkpoint that rank `rank` of `tp` must hold as parameter `name`."""
    module, _, kind = name.rpartition(".")
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        full = ckpt[name]
        per_rank = -(-full.shape[0] // tp)
        mine = full[rank * per_rank : (rank + 1) * per_rank]
        padding = torch.zeros(per_rank - mine.shape[0], full.shape[1])
        return torch.cat([mine, padding])
    if module.endswith("qkv_proj"):
        heads, kv_heads = hf.num_attention_heads, hf.num_key_value_heads
        head_dim = ckpt[module.replace("qkv_proj", "k_proj") + "." + kind].shape[0] // kv_heads
        local = heads // tp
        q_heads = range(rank * local, (rank + 1) * local)
        # GQA: query head h attends with KV head h // (heads / kv_heads).
        kv_of_rank = sorted({h // (heads // kv_heads) for h in q_heads})
        parts = []
        for proj, used in (("q_proj", q_heads), ("k_proj", kv_of_rank), ("v_proj", kv_of_rank)):
            full = ckpt[module.replace("qkv_proj", proj) + "." + kind]
            parts += [full[_rows(h * head_dim, head_dim)] for h in used]
        return torch.cat(parts)
    if module.endswith(("self_attn.q_proj", "q_b_proj", "kv_b_proj")):
        # MLA: rows are grouped per head, so a rank's heads are one run of rows.
        full = ckpt[name]
        local = full.shape[0] // tp
        return full[_rows(rank * local, local)]
    if module.endswith("gate_up_proj"):
        gate = ckpt[module.replace("gate_up_proj", "gate_proj") + "." + kind]
        up = ckpt[module.replace("gate_up_proj", "up_proj") + "." + kind]
        local = gate.shape[0] // tp
        return torch.cat([gate[_rows(rank * local, local)], up[_rows(rank * local, local)]])
    if module.endswith(("o_proj", "down_proj")) and kind == "weight":
        full = ckpt[name]
        local = full.shape[1] // tp
        return full[:, _rows(rank * local, local)]
    if name.endswith(("experts.w13_weight", "experts.w2_weight")):
        layer = name.rpartition(".")[0]
        per_expert = []
        num_experts = getattr(hf, "n_routed_experts", None) or hf.num_experts
        for e in range(num_experts):
            gate, up, down = (
                ckpt[f"{layer}.{e}.{proj}.weight"] for proj in ("gate_proj", "up_proj", "down_proj")
            )
            local = gate.shape[0] // tp
            cols = _rows(rank * local, local)
            per_expert.append(
                torch.cat([gate[cols], up[cols]]) if kind == "w13_weight" else down[:, cols]
            )
        return torch.stack(per_expert)
    return ckpt[name]  # replicated: norms, routers, the shared-expert gate, row biases


def test_two_ranks_give_hf_logits_and_hold_their_shards(tmp_path: Path) -> None:
    paths = {
        case: build_tiny_checkpoint(tmp_path, arch, **overrides)
        for case, (arch, overrides) in CASES.items()
    }
    got = _run_two_ranks(paths)
    for case, path in paths.items():
        hf = tiny_config(CASES[case][0], **CASES[case][1])
        ids = worker.prompt_ids(hf.vocab_size)
        ref = _hf_logits(path, ids)
        ckpt = load_file(f"{path}/model.safetensors")
        for rank in range(TP):
            report = got[rank][case]
            logits = torch.from_numpy(report["logits"])
            assert logits.dtype == torch.float32 and logits.shape == ref.shape, case
            torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4, msg=case)
            # The attention layer (and so the KV cache) is sized for this rank's heads; an MLA
            # layer caches the whole latent whatever its share of the heads.
            if hasattr(hf, "kv_lora_rank"):
                kv = hf.kv_lora_rank + hf.qk_rope_head_dim
            else:
                kv = max(1, hf.num_key_value_heads // TP)
            assert report["attn_heads"] == (hf.num_attention_heads // TP, kv), case
            params = report["params"]
            assert ("lm_head.weight" in params) != bool(hf.tie_word_embeddings), case
            if case not in NAMES_AS_IN_CHECKPOINT:
                continue
            for name, value in params.items():
                expected = expected_shard(name, ckpt, hf, rank, TP)
                assert torch.equal(torch.from_numpy(value), expected), (case, rank, name)
        # Each rank holds a different half of the split tensors (not two full copies).
        for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.o_proj.weight"):
            assert not (got[0][case]["params"][name] == got[1][case]["params"][name]).all()


@pytest.mark.parametrize(
    "arch", ["LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM"]
)
def test_one_rank_calls_no_collective(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str
) -> None:
    """With tp size 1 the parallel layers are ordinary layers: nothing distributed is touched."""

    def forbidden(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a collective ran with tensor_parallel_size 1")

    path = build_tiny_checkpoint(tmp_path, arch, num_hidden_layers=1)
    for fn in ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "broadcast"):
        monkeypatch.setattr(dist, fn, forbidden)
    model = load_model(EngineConfig(model=ModelConfig.from_pretrained(path, dtype="float32")))
    ids = worker.prompt_ids(300)
    logits = model.compute_logits(model(ids, torch.arange(ids.numel())))
    assert logits.shape == (ids.numel(), 300)
