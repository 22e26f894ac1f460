"""tokenwise models against Hugging Face transformers on the same tiny checkpoints.

Outside the engine the attention layer treats the tokens as one causal sequence without a
cache, so a token-wise model can be compared with HF position by position on one sequence.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.tiny_checkpoints import build_tiny_checkpoint
from tokenwise.config import EngineConfig
from tokenwise.layers import get_rope_config
from tokenwise.loader import load_model
from tokenwise.model_config import ModelConfig

SEQ_LEN = 20
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small, so that the sequence spans high, medium and low (scaled) frequencies.
    "original_max_position_embeddings": 16,
}


def _input_ids() -> torch.Tensor:
    return torch.randint(2, 300, (SEQ_LEN,), generator=torch.Generator().manual_seed(0))


def _load(path: str, dtype: str = "float32", **kwargs: Any) -> torch.nn.Module:
    # A fresh EngineConfig per model: attention layers register by name in it.
    return load_model(EngineConfig(model=ModelConfig.from_pretrained(path, dtype=dtype, **kwargs)))


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model.compute_logits(model(ids, torch.arange(ids.numel())))


def _hf_logits(path: str, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    with torch.no_grad():
        return hf(ids[None]).logits[0].float()


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("LlamaForCausalLM", {}),
        ("LlamaForCausalLM", {"rope_scaling": LLAMA3_ROPE}),
        ("LlamaForCausalLM", {"tie_word_embeddings": True}),
        ("MistralForCausalLM", {}),
        ("MistralForCausalLM", {"sliding_window": 6}),
        ("Qwen2ForCausalLM", {}),
        ("Qwen3ForCausalLM", {}),
        ("Qwen3ForCausalLM", {"attention_bias": True}),
    ],
    ids=[
        "llama",
        "llama3-rope",
        "llama-tied",
        "mistral",
        "mistral-window6",
        "qwen2",
        "qwen3",
        "qwen3-bias",
    ],
)
def test_logits_match_hf(tmp_path: Path, arch: str, overrides: dict[str, Any]) -> None:
    path = build_tiny_checkpoint(tmp_path, arch, **overrides)
    ids = _input_ids()
    ours = _logits(_load(path), ids)
    assert ours.dtype == torch.float32 and ours.shape == (SEQ_LEN, 300)
    torch.testing.assert_close(ours, _hf_logits(path, ids), atol=1e-4, rtol=0)


def test_sliding_window_changes_only_positions_past_the_window(tmp_path: Path) -> None:
    ids = _input_ids()
    full = _logits(_load(build_tiny_checkpoint(tmp_path, "MistralForCausalLM")), ids)
    windowed = _logits(
        _load(build_tiny_checkpoint(tmp_path, "MistralForCausalLM", sliding_window=6)), ids
    )
    torch.testing.assert_close(windowed[:6], full[:6], atol=1e-5, rtol=0)
    assert (windowed[6:] - full[6:]).abs().amax(dim=-1).min() > 1e-3


def test_compute_logits_on_selected_rows(tmp_path: Path) -> None:
    model = _load(build_tiny_checkpoint(tmp_path, "LlamaForCausalLM"))
    ids = _input_ids()
    hidden = model(ids, torch.arange(SEQ_LEN))
    assert hidden.shape == (SEQ_LEN, 64)
    rows = torch.tensor([3, SEQ_LEN - 1])
    torch.testing.assert_close(model.compute_logits(hidden[rows]), _logits(model, ids)[rows])


def test_sharded_checkpoint_loads_identically(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    single = build_tiny_checkpoint(tmp_path, "Qwen2ForCausalLM")
    sharded = str(tmp_path / "sharded")
    hf = AutoModelForCausalLM.from_pretrained(single, dtype=torch.float32)
    hf.save_pretrained(sharded, max_shard_size="50KB")
    assert not os.path.exists(os.path.join(sharded, "model.safetensors"))
    index = json.loads(Path(sharded, "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    a, b = _load(single).state_dict(), _load(sharded).state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _write_config(src: str, dst: Path, edit: dict[str, Any], drop: tuple[str, ...]) -> str:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    for key in drop:
        config.pop(key, None)
    config.update(edit)
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


def test_transformers_4_and_5_config_forms_agree(tmp_path: Path) -> None:
    src = build_tiny_checkpoint(tmp_path, "LlamaForCausalLM")
    theta = 50000.0  # not the default, so a reader that ignores rope_theta is caught
    v4 = _write_config(
        src,
        tmp_path / "v4",
        {"torch_dtype": "float32", "rope_theta": theta, "rope_scaling": LLAMA3_ROPE},
        drop=("dtype", "rope_parameters"),
    )
    v5 = _write_config(
        src,
        tmp_path / "v5",
        {"dtype": "float32", "rope_parameters": {**LLAMA3_ROPE, "rope_theta": theta}},
        drop=("torch_dtype", "rope_theta", "rope_scaling"),
    )
    configs = [ModelConfig.from_pretrained(p, dtype="auto") for p in (v4, v5)]
    assert get_rope_config(configs[0].hf_config) == get_rope_config(configs[1].hf_config)
    assert get_rope_config(configs[0].hf_config)[0] == theta
    ids = _input_ids()
    logits_v4, logits_v5 = _logits(_load(v4), ids), _logits(_load(v5), ids)
    torch.testing.assert_close(logits_v4, logits_v5, atol=0, rtol=0)
    torch.testing.assert_close(logits_v5, _hf_logits(v5, ids), atol=1e-4, rtol=0)
    assert not torch.allclose(logits_v5, _logits(_load(src), ids), atol=1e-3)


def test_bf16_logits_close_to_fp32_hf(tmp_path: Path) -> None:
    path = build_tiny_checkpoint(tmp_path, "Qwen3ForCausalLM")
    ids = _input_ids()
    model = _load(path, dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    ours = _logits(model, ids)
    assert ours.dtype == torch.float32
    ref = _hf_logits(path, ids)
    hf_bf16_err = (_hf_logits(path, ids, torch.bfloat16) - ref).abs().mean()
    err = (ours - ref).abs()
    # bf16 keeps 8 significant bits (relative rounding up to 2^-9), and activations are
    # rounded after every op of every layer, so logits of magnitude ~6 drift by ~0.1-0.2 at
    # worst. HF's own bf16 run is the yardstick: our average error may not exceed it by more
    # than 50%, and no logit may be off by more than 5% of the largest logit.
    assert err.mean() <= 1.5 * hf_bf16_err
    assert err.max() <= 0.05 * ref.abs().max()


def _rewrite_weights(path: str, edit: Any) -> None:
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_unknown_architecture_lists_supported(tmp_path: Path) -> None:
    path = build_tiny_checkpoint(tmp_path, "LlamaForCausalLM")
    _write_config(path, tmp_path / "foo", {"architectures": ["FooForCausalLM"]}, drop=())
    with pytest.raises(ValueError, match="FooForCausalLM") as info:
        _load(str(tmp_path / "foo"))
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert arch in str(info.value)


@pytest.mark.parametrize(
    "name", ["model.layers.1.self_attn.k_proj.weight", "model.norm.weight", "lm_head.weight"]
)
def test_missing_tensor_is_named(tmp_path: Path, name: str) -> None:
    path = build_tiny_checkpoint(tmp_path, "LlamaForCausalLM")
    _rewrite_weights(path, lambda t: t.pop(name))
    with pytest.raises(ValueError, match="missing") as info:
        _load(path)
    assert name in str(info.value)


def test_unexpected_tensor_is_named_and_known_extras_are_ignored(tmp_path: Path) -> None:
    path = build_tiny_checkpoint(tmp_path, "LlamaForCausalLM", tie_word_embeddings=True)

    def add_harmless(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
        t["lm_head.weight"] = torch.zeros_like(t["model.embed_tokens.weight"])  # tied: ignored

    _rewrite_weights(path, add_harmless)
    model = _load(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.abs().sum() > 0

    _rewrite_weights(path, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.ones(2)}))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.extra\.weight"):
        _load(path)


@pytest.mark.parametrize(
    ("name", "bad_shape", "expected_shape"),
    [
        ("model.layers.0.mlp.down_proj.weight", (64, 100), (64, 128)),
        ("model.layers.1.self_attn.v_proj.weight", (64, 64), (32, 64)),  # one shard of qkv
    ],
)
def test_shape_mismatch_names_tensor_and_both_shapes(
    tmp_path: Path, name: str, bad_shape: tuple[int, int], expected_shape: tuple[int, int]
) -> None:
    path = build_tiny_checkpoint(tmp_path, "LlamaForCausalLM")
    _rewrite_weights(path, lambda t: t.update({name: torch.zeros(bad_shape)}))
    with pytest.raises(ValueError) as info:
        _load(path)
    message = str(info.value)
    assert name in message and str(bad_shape) in message and str(expected_shape) in message


def test_no_safetensors_is_file_not_found(tmp_path: Path) -> None:
    path = build_tiny_checkpoint(tmp_path, "LlamaForCausalLM")
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        _load(path)


def test_dummy_load_is_deterministic_and_reads_no_weights(tmp_path: Path) -> None:
    src = build_tiny_checkpoint(tmp_path, "Qwen2ForCausalLM")
    bare = tmp_path / "config-only"
    bare.mkdir()
    shutil.copy(os.path.join(src, "config.json"), bare)  # no weights, no tokenizer

    def dummy(seed: int) -> dict[str, torch.Tensor]:
        return _load(str(bare), load_format="dummy", seed=seed).state_dict()

    first, again, other = dummy(0), dummy(0), dummy(1)
    for name, value in first.items():
        assert torch.equal(value, again[name]), name
        if name.endswith("bias"):
            assert torch.all(value == 0), name
        elif value.dim() == 1:
            assert torch.all(value == 1), name
        else:
            assert not torch.equal(value, other[name]), name
            assert 0.01 < value.std() < 0.04, name


def test_models_know_nothing_about_batches_or_caches() -> None:
    models_dir = Path(__file__).resolve().parents[2] / "tokenwise" / "models"
    files = sorted(models_dir.glob("*.py"))
    # The MLA model too: its latent cache lives in the attention layer, not in the model.
    assert {"deepseek_v2.py", "deepseek_moe.py", "llama.py"} <= {f.name for f in files}
    words = ("attn_metadata", "attention_metadata", "slot_mapping", "kv_cache", "latent_cache")
    for file in files:
        text = file.read_text().lower()
        for word in (*words, "block_table"):
            assert word not in text, f"{file.name} mentions {word}"
