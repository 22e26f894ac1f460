"""Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5 dense and MoE) against transformers, end to end.

Each architecture gets one tiny random checkpoint (4 layers: three linear-attention, one gated
full attention) and its greedy continuations from transformers' `generate` (fp32) of prompts
that share a 40-token prefix. tokenwise must give the same tokens in one batch; with a
16-token budget (so every prompt is prefilled over several steps, each continuing from the
conv and delta-rule state its slot holds) and a pool too small for all prompts (so requests
are preempted and recomputed); and again on that engine with prefix caching, the shared
prefix hitting the state snapshots the first pass left. Tensor parallelism (heads split, conv
channels split to match) and n-gram speculative decoding (drafts rejected: the state rolled
back to the last accepted token) must not change a token either.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.engine._fixtures import assert_pool_clean, hf_greedy
from tests.tiny_checkpoints import build_tiny_checkpoint
from tokenwise import LLM, SamplingParams
from tokenwise.models import gated_deltanet

ARCHS = ["Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"]
MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
SHARED = list(range(5, 45))  # 40 tokens: two and a half blocks of 16
PROMPTS = [
    SHARED + list(range(200, 230)),
    SHARED + [7, 9, 11, 13, 15, 17, 19, 21, 23],
    [60, 61, 62, 63, 64, 65],
]
# Repeats itself, so n-gram drafts are proposed; the model's continuation rejects most.
REPETITIVE = [11, 12, 13, 14, 15, 16, 17, 18] * 5


def _hf_greedy(path: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    return [hf_greedy(path, p, max_tokens) for p in prompts]


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, list[list[int]]]]:
    """arch -> (checkpoint, HF's greedy tokens for PROMPTS)."""
    root = tmp_path_factory.mktemp("gdn")
    out = {}
    for arch in ARCHS:
        path = build_tiny_checkpoint(root / arch, arch)
        out[arch] = (path, _hf_greedy(path, PROMPTS, MAX_TOKENS))
    return out


def make(path: str, **kwargs: Any) -> LLM:
    return LLM(path, dtype="float32", block_size=16, **{"num_gpu_blocks": 64, **kwargs})


def generate(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("arch", ARCHS)
def test_one_batch_equals_hf(cases: dict, arch: str) -> None:
    path, want = cases[arch]
    assert generate(make(path), PROMPTS) == want


def test_torch_decode_step_without_the_kernel_equals_hf(
    cases: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the C kernels do not apply (GPU, other dtypes, no compiler) the torch step runs."""
    monkeypatch.setattr(gated_deltanet, "gated_delta_decode_step", lambda *args: False)
    monkeypatch.setattr(gated_deltanet, "gated_delta_decode", lambda *args: None)
    path, want = cases["Qwen3NextForCausalLM"]
    assert generate(make(path), PROMPTS) == want


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_preemption_and_prefix_hits_equal_hf(cases: dict, arch: str) -> None:
    path, want = cases[arch]
    # 16 tokens a step; 7 blocks of 16 for prompts needing 5 + 4 + 2 at their end.
    llm = make(path, max_num_batched_tokens=16, num_gpu_blocks=7, max_model_len=96)
    engine = llm.llm_engine
    assert generate(llm, PROMPTS) == want
    assert engine.scheduler.num_preemptions > 0
    hits = engine.get_stats().prefix_cache_hits
    assert generate(llm, PROMPTS) == want
    assert engine.get_stats().prefix_cache_hits - hits >= 32  # the shared prefix, at least
    assert_pool_clean(engine)


def test_ngram_speculative_decoding_is_lossless(cases: dict) -> None:
    path, _ = cases["Qwen3_5MoeForCausalLM"]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = _hf_greedy(path, [REPETITIVE], 40)
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    llm = make(path, speculative_config=spec)
    assert generate(llm, [REPETITIVE], params) == want
    stats = llm.llm_engine.get_stats()
    assert 0 < stats.spec_decode_num_draft_tokens
    assert stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens


@pytest.mark.parametrize("arch", ["Qwen3NextForCausalLM", "Qwen3_5ForCausalLM"])
def test_tensor_parallel_equals_hf(cases: dict, arch: str) -> None:
    path, want = cases[arch]
    llm = make(path, tensor_parallel_size=2)
    try:
        assert generate(llm, PROMPTS) == want
    finally:
        llm.shutdown()


def with_mtp_head(path: str, out: Path) -> str:
    """A copy of a checkpoint with an MTP head as the published ones carry it (`mtp.*`; its
    layer a noisy copy of the last, full-attention, layer); transformers ignores it."""
    tensors = load_file(f"{path}/model.safetensors")
    gen = torch.Generator().manual_seed(7)
    hidden = tensors["model.norm.weight"].shape[0]
    last = "model.layers.3."
    for name, t in list(tensors.items()):
        if name.startswith(last):
            noise = torch.randn(t.shape, generator=gen) * 0.05
            tensors["mtp.layers.0." + name[len(last) :]] = t + noise
    tensors["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=gen) * 0.2
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{norm}.weight"] = torch.randn(hidden, generator=gen) * 0.1
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"))
    for item in Path(path).iterdir():
        if item.name != "model.safetensors":
            (out / item.name).write_bytes(item.read_bytes())
    return str(out)


@pytest.mark.parametrize("arch", ["Qwen3NextForCausalLM", "Qwen3_5ForCausalLM"])
def test_mtp_speculative_decoding_is_lossless(cases: dict, arch: str, tmp_path: Path) -> None:
    """The checkpoint's MTP head drafts (its own KV cache, the target's embedding and LM
    head); greedy output stays HF's, through prefix hits too."""
    path, want = cases[arch]
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    llm = make(with_mtp_head(path, tmp_path / "mtp"), speculative_config=spec)
    assert generate(llm, PROMPTS) == want
    assert generate(llm, PROMPTS) == want
    stats = llm.llm_engine.get_stats()
    assert stats.spec_decode_num_draft_tokens > 0 and stats.prefix_cache_hits > 0
    assert_pool_clean(llm.llm_engine)


def test_mtp_without_the_head_is_refused_by_name(cases: dict) -> None:
    path, _ = cases["Qwen3_5ForCausalLM"]
    with pytest.raises(ValueError, match=r"'mtp' needs .*MTP head \(mtp.\* tensors\).*Qwen3_5"):
        make(path, speculative_config={"method": "mtp", "num_speculative_tokens": 1})


def test_a_pipeline_split_with_one_layer_kind_on_a_stage_is_refused(cases: dict) -> None:
    """Four layers (three linear, one full) in two stages of two: stage 0 would hold no
    attention layer, so the stages' KV-cache groups would differ (tests/engine/
    test_pipeline_parallel_models.py runs a split that works)."""
    path, _ = cases["Qwen3NextForCausalLM"]
    with pytest.raises(
        ValueError, match=r"splits the layers \[2, 2\], which gives stage 0 only linear_attention"
    ):
        make(path, pipeline_parallel_size=2)


def test_conditional_generation_checkpoint_needs_its_whole_tower(
    cases: dict, tmp_path: Path
) -> None:
    """The published layout (the decoder under `model.language_model.`, a composite config)
    builds the vision tower (`tests/models/test_qwen3_5_vl.py` runs it against HF): a
    checkpoint with only part of the tower's tensors is refused, naming the missing ones."""
    path, _ = cases["Qwen3_5ForCausalLM"]
    text_config = json.loads((Path(path) / "config.json").read_text())
    tensors = load_file(f"{path}/model.safetensors")
    renamed = {
        name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name: t
        for name, t in tensors.items()
    }
    renamed["model.visual.patch_embed.proj.weight"] = torch.zeros(8, 3, 2, 4, 4)
    renamed["mtp.fc.weight"] = torch.zeros(4, 4)
    out = tmp_path / "vl"
    out.mkdir()
    save_file(renamed, str(out / "model.safetensors"))
    for item in Path(path).iterdir():
        if item.name not in ("config.json", "model.safetensors"):
            (out / item.name).write_bytes(item.read_bytes())
    config = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": {**text_config, "model_type": "qwen3_5_text"},
        "vision_config": {
            "depth": 1,
            "hidden_size": 8,
            "out_hidden_size": 64,
            "num_heads": 1,
            "patch_size": 4,
            "num_position_embeddings": 16,
        },
    }
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError, match=r"Qwen3_5ForConditionalGeneration is missing tensors: visual\.blocks\.0"
    ):
        make(str(out))


def test_mtp_first_draft_is_the_head_computed_with_transformers_modules(
    cases: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The head's math checked independently: its first draft after a prompt equals the head
    assembled from transformers' own Qwen3-Next modules (its decoder layer, zero-centred
    norms) over the target's final hidden states and the next tokens, argmax of the LM head."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_next import modeling_qwen3_next as hf_mod

    from tokenwise.spec_decode.eagle_runner import EagleRunner

    path, want = cases["Qwen3NextForCausalLM"]
    mtp_path = with_mtp_head(path, tmp_path / "mtp")
    prompt = PROMPTS[0]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tensors = load_file(f"{mtp_path}/model.safetensors")
    cfg = hf.config
    layer = hf_mod.Qwen3NextDecoderLayer(cfg, cfg.layer_types.index("full_attention")).eval()
    own = {n[len("mtp.layers.0.") :]: t for n, t in tensors.items() if "mtp.layers.0." in n}
    experts = {}
    for proj in ("gate_proj", "up_proj", "down_proj"):
        stacked = torch.stack([own.pop(f"mlp.experts.{e}.{proj}.weight") for e in range(8)])
        experts[proj] = stacked
    own["mlp.experts.gate_up_proj"] = torch.cat([experts["gate_proj"], experts["up_proj"]], 1)
    own["mlp.experts.down_proj"] = experts["down_proj"]
    own["mlp.gate.weight"] = own.pop("mlp.gate.weight")
    layer.load_state_dict(own)

    def norm(name: str) -> hf_mod.Qwen3NextRMSNorm:
        module = hf_mod.Qwen3NextRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        module.weight.data.copy_(tensors[f"mtp.{name}.weight"])
        return module

    with torch.no_grad():
        ids = torch.tensor([prompt])
        hidden = hf.model(ids).last_hidden_state[0]
        nxt = torch.tensor(prompt[1:] + [want[0][0]])
        x = (
            torch.cat(
                [
                    norm("pre_fc_norm_embedding")(hf.model.embed_tokens(nxt)),
                    norm("pre_fc_norm_hidden")(hidden),
                ],
                dim=-1,
            )
            @ tensors["mtp.fc.weight"].T
        )
        positions = torch.arange(len(prompt))[None]
        rope = hf.model.rotary_emb(x[None], positions)
        mask = torch.full((len(prompt), len(prompt)), float("-inf")).triu(1)[None, None]
        out = layer(x[None], position_embeddings=rope, attention_mask=mask, position_ids=positions)
        out = out[0] if isinstance(out, tuple) else out
        expected = int(hf.lm_head(norm("norm")(out[0, -1])).argmax())

    first: list[list[int]] = []
    run_head = EagleRunner.run_head

    def recording(self: EagleRunner, seqs: list, features: list) -> tuple:
        tokens, rows = run_head(self, seqs, features)
        if not first:
            first.append(tokens)
        return tokens, rows

    monkeypatch.setattr(EagleRunner, "run_head", recording)
    spec = {"method": "mtp", "num_speculative_tokens": 1}
    assert generate(make(mtp_path, speculative_config=spec), [prompt]) == [want[0]]
    assert first == [[expected]]
