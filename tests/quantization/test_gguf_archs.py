"""GGUF files of Gemma 2, Gemma 3, Gemma 4, Mixtral (llama with experts), Qwen2-MoE and
Qwen3-MoE load into tokenwise and compute what transformers computes.

References, per architecture:
- Gemma 2 / 3, Qwen2-MoE, Qwen3-MoE: transformers loading the same `.gguf` (its loader
  dequantizes with gguf-py, takes Gemma's norms' one back off and stacks the experts, as ours
  does), but with the original checkpoint's config: transformers' GGUF config reader drops
  Gemma's softcaps, query scale, layer types and local rope base, and the MoE experts' width,
  so a config it reads from the file would not be the model the file holds. Our config read
  from the file is checked against that original config.
- Mixtral: transformers' GGUF loader reads a llama file with experts as a dense Llama, so the
  reference is transformers' Mixtral on the checkpoint as the file stores it (`dense_dir`:
  every tensor dequantized from the file's own blocks).
- Gemma 4 (the tiny shapes of tests/models/test_gemma4_vs_hf.py: k=v global layers; per-layer
  embeddings with KV sharing; routed experts): transformers' Gemma 4 on the checkpoint as the
  file stores it, as for Mixtral.
Both sides hold the same float32 weights, so the bar is the repo's 1e-4 on fp32 logits.
"""

from __future__ import annotations

import os
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from tests.quantization._gguf_files import write_gguf
from tests.tiny_checkpoints import build_tiny_checkpoint, tiny_tokenizer
from tokenwise import LLM, SamplingParams
from tokenwise.config import EngineConfig
from tokenwise.gguf.gemma4_config import gemma4_kwargs
from tokenwise.gguf.gemma_config import gemma_kwargs
from tokenwise.gguf.moe_config import moe_kwargs
from tokenwise.layers.quantization.weight_only import QuantizedExperts, reference_dequantize
from tokenwise.loader import load_model
from tokenwise.model_config import ModelConfig

pytestmark = pytest.mark.usefixtures("exact_fp32_activations")  # compared with transformers

Q = gguf.GGMLQuantizationType
ATOL = 1e-4
SEQ_LEN = 24  # past the sliding window of 8: sliding and global layers differ
# Files as llama.cpp writes them carry no query scale and no layer types: llama.cpp scales by
# head_dim (16 here) and slides every other layer (Gemma 2) or five of six (Gemma 3), so the
# tiny checkpoints follow those rules. Gemma 3's local rope base is not the default 10000, so
# reading `rope.freq_base_swa` is checked.
SIX_LAYERS = ["sliding_attention"] * 5 + ["full_attention"]
GEMMA4_E = {
    "attention_k_eq_v": False,
    "hidden_size_per_layer_input": 8,
    "vocab_size_per_layer_input": len(tiny_tokenizer()),
    "num_kv_shared_layers": 2,
    "use_double_wide_mlp": True,
}
GEMMA4_MOE = {
    "enable_moe_block": True,
    "num_experts": 4,
    "top_k_experts": 2,
    "moe_intermediate_size": 32,
}
ARCHS = {
    "gemma2": ("Gemma2ForCausalLM", {"query_pre_attn_scalar": 16}),
    "gemma3": (
        "Gemma3ForCausalLM",
        {
            "query_pre_attn_scalar": 16,
            "num_hidden_layers": 6,
            "layer_types": SIX_LAYERS,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 20000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 4.0},
            },
        },
    ),
    "gemma4": ("Gemma4ForCausalLM", {}),
    "gemma4_e": ("Gemma4ForCausalLM", GEMMA4_E),
    "gemma4_moe": ("Gemma4ForCausalLM", GEMMA4_MOE),
    "mixtral": ("MixtralForCausalLM", {}),
    # K-quant blocks hold 256 values: experts with rows of 256.
    "mixtral_wide": ("MixtralForCausalLM", {"hidden_size": 256, "intermediate_size": 256}),
    "qwen2moe": ("Qwen2MoeForCausalLM", {}),
    "qwen3moe": ("Qwen3MoeForCausalLM", {}),
}
# Checkpoint names of each MoE architecture's experts: (module, gate, up, down).
EXPERTS = {
    "mixtral": ("block_sparse_moe.experts", "w1", "w3", "w2"),
    "mixtral_wide": ("block_sparse_moe.experts", "w1", "w3", "w2"),
    "qwen2moe": ("mlp.experts", "gate_proj", "up_proj", "down_proj"),
    "qwen3moe": ("mlp.experts", "gate_proj", "up_proj", "down_proj"),
}
PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Hello world! Hello"]
MAX_TOKENS = 8


@pytest.fixture(autouse=True)
def _tokenizer_cache(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENWISE_GGUF_CACHE", str(tmp_path / "tokenizers"))


def _files(tmp_path: Any, arch: str, qtype: Any) -> tuple[str, str, str]:
    """(original checkpoint, GGUF file, the checkpoint as the file stores it)."""
    cls, overrides = ARCHS[arch]
    hf_dir = build_tiny_checkpoint(tmp_path, cls, **overrides)
    dense = str(tmp_path / f"{arch}-{qtype.name}-dense")
    path = write_gguf(hf_dir, str(tmp_path / f"{arch}-{qtype.name}.gguf"), qtype, dense_dir=dense)
    return hf_dir, path, dense


def _reference(arch: str, hf_dir: str, path: str, dense: str) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    if arch.startswith(("mixtral", "gemma4")):
        return AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    directory, name = os.path.split(path)
    config = AutoConfig.from_pretrained(hf_dir)
    return AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, config=config, dtype=torch.float32
    ).eval()


def _ids() -> torch.Tensor:
    return torch.randint(2, 300, (SEQ_LEN,), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def _ours(path: str) -> tuple[Any, torch.Tensor]:
    config = ModelConfig.from_pretrained(path, dtype="float32", skip_tokenizer_init=True)
    net = load_model(EngineConfig(model=config))
    ids = _ids()
    return net, net.compute_logits(net(ids, torch.arange(ids.numel())))


CASES = [(a, q) for a in ("gemma2", "gemma3") for q in (Q.F32, Q.F16, Q.Q8_0)]
CASES += [(a, q) for a in ("gemma4", "gemma4_e", "gemma4_moe") for q in (Q.F32, Q.Q8_0)]
CASES += [("mixtral", q) for q in (Q.F32, Q.F16, Q.Q8_0, Q.Q4_0)]
CASES += [("mixtral_wide", Q.Q4_K), ("mixtral_wide", Q.Q6_K)]
CASES += [(a, q) for a in ("qwen2moe", "qwen3moe") for q in (Q.F16, Q.Q8_0, Q.Q4_0)]
BITS = {Q.Q8_0: 8, Q.Q4_0: 4, Q.Q4_K: 4, Q.Q6_K: 8}


@pytest.mark.parametrize(("arch", "qtype"), CASES, ids=lambda v: getattr(v, "name", v))
def test_logits_match_hf(tmp_path: Any, arch: str, qtype: Any) -> None:
    hf_dir, path, dense = _files(tmp_path, arch, qtype)
    net, ours = _ours(path)
    with torch.no_grad():
        reference = _reference(arch, hf_dir, path, dense)(_ids()[None]).logits[0]
    assert reference.std() > 0.1
    torch.testing.assert_close(ours, reference, atol=ATOL, rtol=0)
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))
    if arch in EXPERTS and qtype in BITS:
        _assert_experts_hold_the_file(net, dense, BITS[qtype], EXPERTS[arch])


def _assert_experts_hold_the_file(net: Any, dense: str, bits: int, names: tuple) -> None:
    """Every expert stays quantized with the file's bit width, and its integers and scales
    decode to exactly the values the file stores (the file's blocks, not a re-rounding)."""
    from safetensors.torch import load_file

    stored = load_file(os.path.join(dense, "model.safetensors"))
    for i, layer in enumerate(net.model.layers):
        experts = layer.mlp.experts.quant_experts
        assert isinstance(experts, QuantizedExperts)
        assert layer.mlp.experts.w13_weight.device.type == "meta"  # no dense copy kept
        for e, (w13, w2) in enumerate(zip(experts.w13, experts.w2, strict=True)):
            assert w13.bits == w2.bits == bits
            module, gate, up, down = names
            prefix = f"model.layers.{i}.{module}.{e}"
            gate_up = torch.cat(
                [stored[f"{prefix}.{gate}.weight"], stored[f"{prefix}.{up}.weight"]]
            )
            assert torch.equal(reference_dequantize(w13), gate_up)
            assert torch.equal(reference_dequantize(w2), stored[f"{prefix}.{down}.weight"])


FIELDS = {
    "gemma": (
        "query_pre_attn_scalar",
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "sliding_window",
        "layer_types",
        "head_dim",
        "rope_parameters",
        "tie_word_embeddings",
    ),
    "mixtral": ("num_local_experts", "num_experts_per_tok", "intermediate_size", "sliding_window"),
    "qwen2": (
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "norm_topk_prob",
    ),
    "qwen3": (
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "norm_topk_prob",
        "head_dim",
    ),
}


FIELDS["gemma4"] = (
    "layer_types",
    "sliding_window",
    "final_logit_softcapping",
    "rope_parameters",
    "attention_k_eq_v",
    "num_kv_shared_layers",
    "use_double_wide_mlp",
    "hidden_size_per_layer_input",
    "vocab_size_per_layer_input",
    "intermediate_size",
    "tie_word_embeddings",
    "enable_moe_block",
    "num_experts",
    "top_k_experts",
    "moe_intermediate_size",
)
CONFIG_ARCHS = ["gemma2", "gemma3", "gemma4", "gemma4_e", "gemma4_moe", "mixtral", "qwen2moe"]
CONFIG_ARCHS += ["qwen3moe"]


@pytest.mark.parametrize("arch", CONFIG_ARCHS)
def test_config_from_the_file_is_the_checkpoints(tmp_path: Any, arch: str) -> None:
    """What llama.cpp's metadata and rules give equals the original config, field by field
    (Gemma 4: also each layer's head size and KV heads)."""
    from transformers import AutoConfig

    hf_dir, path, _ = _files(tmp_path, arch, Q.F32)
    ours = ModelConfig.from_pretrained(path, skip_tokenizer_init=True).hf_config
    original = AutoConfig.from_pretrained(hf_dir)
    assert type(ours) is type(original)
    key = "gemma4" if arch.startswith("gemma4") else arch
    fields = (
        FIELDS[key] if key in FIELDS else next(v for k, v in FIELDS.items() if key.startswith(k))
    )
    for field in fields:
        assert getattr(ours, field, None) == getattr(original, field, None), field
    if key == "gemma4":
        for i in range(original.num_hidden_layers):
            mine, theirs = ours.per_layer_config[i], original.per_layer_config[i]
            assert (mine.head_dim, mine.num_key_value_heads) == (
                theirs.head_dim,
                theirs.num_key_value_heads,
            ), i


def test_mixtral_f32_file_round_trips_to_the_checkpoint_exactly(tmp_path: Any) -> None:
    """The stacked expert tensors split back into the right experts and projections (a swap
    moves logits by O(1)), independently of HF."""
    hf_dir, path, _ = _files(tmp_path, "mixtral", Q.F32)
    config = ModelConfig.from_pretrained(hf_dir, dtype="float32", skip_tokenizer_init=True)
    net = load_model(EngineConfig(model=config))
    ids = _ids()
    with torch.no_grad():
        expected = net.compute_logits(net(ids, torch.arange(ids.numel())))
    assert torch.equal(_ours(path)[1], expected)


@torch.no_grad()
def _hf_greedy(model: Any, ids: list[int], steps: int) -> list[int]:
    out = list(ids)
    for _ in range(steps):
        out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids) :]


@pytest.mark.parametrize(
    ("arch", "qtype"),
    [
        ("gemma2", Q.Q8_0),
        ("gemma3", Q.Q8_0),
        ("gemma4_e", Q.Q8_0),
        ("mixtral", Q.Q8_0),
        ("mixtral", Q.Q4_0),
        ("qwen3moe", Q.Q4_0),
    ],
    ids=lambda v: getattr(v, "name", v),
)
def test_greedy_generation_matches_hf(tmp_path: Any, arch: str, qtype: Any) -> None:
    """The engine end to end on the file: HF's greedy tokens. The MoE files' tokenizer comes
    from the file's metadata; the Gemma files carry the tiny byte-level BPE, which transformers'
    Gemma GGUF converter (SentencePiece-only) does not take, so they get the original
    tokenizer directory (`tokenizer=`) as a user of such a file would pass it."""
    hf_dir, path, dense = _files(tmp_path, arch, qtype)
    tokenizer = hf_dir if arch.startswith("gemma") else None
    # Ample for every layout: a Gemma block holds one layer group, not all layers.
    llm = LLM(path, tokenizer=tokenizer, dtype="float32", num_gpu_blocks=256)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params)
    reference = _reference(arch, hf_dir, path, dense)
    for output in outputs:
        expected = _hf_greedy(reference, output.prompt_token_ids, MAX_TOKENS)
        assert output.outputs[0].token_ids == expected


def _gemma(arch: str, layers: int = 4, **metadata: Any) -> dict[str, Any]:
    base = {"num_hidden_layers": layers, "head_dim": 16, "hidden_size": 64}
    base["num_attention_heads"] = 8
    return gemma_kwargs({f"{arch}.{k}": v for k, v in metadata.items()}, arch, base)


def test_gemma_rules_for_what_the_file_leaves_out() -> None:
    """llama.cpp's rules, stated independently: the query scale (a written `attention.scale`,
    else head_dim, else hidden / heads for the 27B layer counts), which layers slide (a
    written period or per-layer flags), Gemma 2's default softcaps."""
    assert _gemma("gemma2")["query_pre_attn_scalar"] == 16
    assert _gemma("gemma2", **{"attention.scale": 0.125})["query_pre_attn_scalar"] == 64
    assert _gemma("gemma2", layers=46)["query_pre_attn_scalar"] == 8  # 64 / 8 heads
    assert _gemma("gemma3", layers=62)["query_pre_attn_scalar"] == 8
    slide, full = "sliding_attention", "full_attention"
    assert _gemma("gemma2")["layer_types"] == [slide, full, slide, full]
    assert _gemma("gemma3", layers=7)["layer_types"] == [slide] * 5 + [full, slide]
    flags = {"attention.sliding_window_pattern": [True, False, False, True]}
    assert _gemma("gemma3", **flags)["layer_types"] == [slide, full, full, slide]
    period = {"attention.sliding_window_pattern": 3}
    assert _gemma("gemma3", layers=3, **period)["layer_types"] == [slide, slide, full]
    gemma2 = _gemma("gemma2")
    assert (gemma2["attn_logit_softcapping"], gemma2["final_logit_softcapping"]) == (50.0, 30.0)
    assert _gemma("gemma3")["attn_logit_softcapping"] is None
    assert _gemma("gemma3")["rope_local_base_freq"] == 10000.0


def test_bad_moe_and_gemma_metadata_name_the_key() -> None:
    with pytest.raises(ValueError, match="gemma3.attention.sliding_window_pattern has 2 flags"):
        _gemma("gemma3", **{"attention.sliding_window_pattern": [True, False]})
    with pytest.raises(ValueError, match="sliding_window_pattern must be >= 1, got 0"):
        _gemma("gemma2", **{"attention.sliding_window_pattern": 0})
    metadata = {"qwen3moe.expert_count": 4, "qwen3moe.expert_used_count": 5}
    with pytest.raises(ValueError, match=r"qwen3moe.expert_used_count must be in \[1, "):
        moe_kwargs(metadata, "qwen3moe", lambda name: metadata[f"qwen3moe.{name}"])


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0], ids=lambda q: q.name)
def test_experts_keep_the_files_bytes(tmp_path: Any, qtype: Any) -> None:
    """Each expert's integers and float16 scales are the very bytes of its slice of the stacked
    tensors (gate rows then up rows in `w13`), read here straight from the file's blocks."""
    _, path, _ = _files(tmp_path, "mixtral", qtype)
    net, _ = _ours(path)
    experts = net.model.layers[1].mlp.experts.quant_experts
    block = 34 if qtype == Q.Q8_0 else 18
    tensors = {t.name: t.data for t in gguf.GGUFReader(path).tensors}
    for e, (w13, w2) in enumerate(zip(experts.w13, experts.w2, strict=True)):
        gate, up = tensors["blk.1.ffn_gate_exps.weight"][e], tensors["blk.1.ffn_up_exps.weight"][e]
        for weight, raw in (
            (w13, np.concatenate([gate, up])),
            (w2, tensors["blk.1.ffn_down_exps.weight"][e]),
        ):
            blocks = raw.reshape(raw.shape[0], -1, block)
            scales = torch.from_numpy(blocks[..., :2].copy().view("float16"))[..., 0]
            data = torch.from_numpy(blocks[..., 2:].reshape(raw.shape[0], -1).copy())
            assert torch.equal(weight.scales, scales)
            assert torch.equal(weight.qweight, data.view(torch.int8) if block == 34 else data)


def _gemma4(factors: np.ndarray | None = None, **metadata: Any) -> dict[str, Any]:
    base = {"num_hidden_layers": 2}
    meta = {
        "attention.sliding_window_pattern": [True, False],
        "attention.key_length": 32,
        "attention.key_length_swa": 16,
        "attention.head_count_kv": 2,
        "feed_forward_length": 64,
        "attention.sliding_window": 8,
        "rope.freq_base": 1e6,
        **metadata,
    }
    factors = np.array([1.0] * 4 + [1e30] * 12) if factors is None else factors
    names = ("blk.1.attn_v.weight",)
    return gemma4_kwargs({f"gemma4.{k}": v for k, v in meta.items()}, names, {}, factors, base, "f")


def test_gemma4_metadata_gives_proportional_rope_and_refuses_what_is_not_built() -> None:
    """The rope factors (1 for rotated pairs, 1e30 for the others) are proportional RoPE with
    a quarter rotated; experts make the MoE block; a missing key, other factors and a bad
    layer pattern are refused by name."""
    full = _gemma4()["rope_parameters"]["full_attention"]
    assert (full["rope_type"], full["partial_rotary_factor"]) == ("proportional", 0.25)
    moe = _gemma4(expert_count=4, expert_used_count=2, expert_feed_forward_length=32)
    assert (moe["enable_moe_block"], moe["num_experts"], moe["top_k_experts"]) == (True, 4, 2)
    with pytest.raises(ValueError, match="lacks the metadata key gemma4.expert_used_count"):
        _gemma4(expert_count=4)
    with pytest.raises(ValueError, match="sliding_window_pattern must hold one flag per layer"):
        _gemma4(**{"attention.sliding_window_pattern": [True]})
    with pytest.raises(ValueError, match="feed_forward_length has 3 values for 2 layers"):
        _gemma4(feed_forward_length=[64, 64, 64])
    with pytest.raises(NotImplementedError, match="rope_freqs.weight must rotate the first"):
        _gemma4(factors=np.array([1.0] * 4 + [2.0] * 12))
