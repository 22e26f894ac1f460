"""`quantization="int8" | "int4"` and GGUF files through the engine.

Reference: the same checkpoint with every linear weight replaced by its quantized-then-
dequantized values (`reference_dequantize`, torch ops), loaded by transformers. A quantized
tokenwise model holds exactly those weights, so the only difference left is fp32 kernel order:
the repo's HF parity bar (1e-4 on logits, the same greedy tokens) applies unchanged. Quantizing
the fused q/k/v and gate/up layers is the same as quantizing each part, since groups run along
rows. Separately, the quantization error against the float model is real and ordered.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import gguf
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.engine._fixtures import hf_greedy, mixed_prompts
from tests.quantization._gguf_files import write_gguf
from tests.tiny_checkpoints import build_tiny_checkpoint
from tokenwise import LLM, SamplingParams
from tokenwise.config import EngineConfig
from tokenwise.layers.quantization.weight_only import (
    QuantizedWeight,
    quantize,
    reference_dequantize,
)
from tokenwise.loader import load_model
from tokenwise.model_config import ModelConfig
from tokenwise.quantization_config import resolve_quantization

SCHEMES = {"int8": (8, True, 32), "int4": (4, False, 64)}
LINEAR = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head",
    "embed_tokens", "kv_a_proj_with_mqa",
)  # fmt: skip
MAX_TOKENS = 8
# Widths that are multiples of the group size (32), so every linear layer is quantized.
SHAPE = {"hidden_size": 64, "intermediate_size": 128}


def _checkpoint(tmp_path: Any, arch: str = "LlamaForCausalLM", **extra: Any) -> str:
    return build_tiny_checkpoint(tmp_path, arch, **SHAPE, **extra)


def _dequantized_copy(path: str, out: str, bits: int, symmetric: bool, group: int) -> str:
    """The checkpoint with every linear weight replaced by its quantized values, in float32."""
    shutil.copytree(path, out)
    file = os.path.join(out, "model.safetensors")
    state = load_file(file)
    for name, value in state.items():
        if value.dim() == 2 and any(f"{part}." in name for part in LINEAR):
            # The engine's fallback where the group does not divide the row (experts: 32).
            fits = group if value.shape[1] % group == 0 else 32
            state[name] = reference_dequantize(quantize(value.float(), bits, fits, symmetric))
    save_file(state, file, metadata={"format": "pt"})
    return out


@torch.no_grad()
def _logits(model: str, ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    config = ModelConfig.from_pretrained(model, dtype="float32", skip_tokenizer_init=True, **kwargs)
    net = load_model(EngineConfig(model=config))
    return net.compute_logits(net(ids, torch.arange(ids.numel())))


def _ids() -> torch.Tensor:
    return torch.randint(2, 300, (24,), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("method", sorted(SCHEMES))
@pytest.mark.parametrize(
    "arch", ["LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"]
)
def test_quantized_model_computes_its_dequantized_weights(
    tmp_path: Any, method: str, arch: str
) -> None:
    path = _checkpoint(tmp_path, arch)
    reference = _dequantized_copy(path, str(tmp_path / "dequantized"), *SCHEMES[method])
    ids = _ids()
    ours = _logits(path, ids, quantization=method)
    expected = _logits(reference, ids)  # the dense model over the dequantized weights
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)
    dense = _logits(path, ids)
    assert (ours - dense).abs().max() > 1e-3  # the weights really were quantized
    if "Moe" in arch:  # the routed experts too, and the routers stay dense
        config = ModelConfig.from_pretrained(path, dtype="float32", quantization=method)
        mlp = load_model(EngineConfig(model=config)).model.layers[0].mlp
        assert mlp.experts.quant_experts is not None
        assert mlp.experts.w13_weight.is_meta and mlp.gate.quant_weight is None


def test_latent_attention_keeps_its_absorbed_projection_dense(tmp_path: Any) -> None:
    """DeepSeek's attention reads kv_b_proj's weight itself: it stays dense, the rest is int8,
    and the model still computes its (partly) dequantized weights."""
    path = build_tiny_checkpoint(tmp_path, "DeepseekV2ForCausalLM", **SHAPE)
    config = ModelConfig.from_pretrained(path, dtype="float32", quantization="int8")
    model = load_model(EngineConfig(model=config))
    attn = model.model.layers[0].self_attn
    assert attn.kv_b_proj.quant_weight is None and attn.kv_b_proj.weight.device.type == "cpu"
    assert isinstance(attn.o_proj.quant_weight, QuantizedWeight)
    reference = _dequantized_copy(path, str(tmp_path / "dequantized"), *SCHEMES["int8"])
    ids = _ids()
    with torch.no_grad():
        logits = model.compute_logits(model(ids, torch.arange(ids.numel())))
    torch.testing.assert_close(logits, _logits(reference, ids), atol=1e-4, rtol=0)
    assert (logits - _logits(path, ids)).abs().max() > 1e-3  # quantized, not the dense model


def test_int4_moves_logits_more_than_int8(tmp_path: Any) -> None:
    path = _checkpoint(tmp_path)
    ids = _ids()
    dense = _logits(path, ids)
    int8 = (_logits(path, ids, quantization="int8") - dense).abs().max()
    int4 = (_logits(path, ids, quantization="int4") - dense).abs().max()
    assert 0 < int8 < int4


@pytest.mark.parametrize("method", sorted(SCHEMES))
def test_engine_gives_hf_greedy_tokens_of_the_dequantized_weights(
    tmp_path: Any, method: str
) -> None:
    """Chunked prefill (16-token chunks), preemption (8 blocks) and decode batches of 1 to 6
    rows: every row count goes through the kernel or the dequantized matmul."""
    path = _checkpoint(tmp_path)
    reference = _dequantized_copy(path, str(tmp_path / "dequantized"), *SCHEMES[method])
    llm = LLM(
        path,
        dtype="float32",
        quantization=method,
        num_gpu_blocks=8,
        max_model_len=128,
        max_num_batched_tokens=16,
    )
    prompts = mixed_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(reference, prompt, MAX_TOKENS)
    stats = llm.llm_engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_layers_hold_quantized_weights_only(tmp_path: Any) -> None:
    path = _checkpoint(tmp_path, tie_word_embeddings=True)
    config = ModelConfig.from_pretrained(path, dtype="bfloat16", quantization="int4")
    model = load_model(EngineConfig(model=config))
    layer = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(layer.quant_weight, QuantizedWeight)
    assert layer.quant_weight.bits == 4 and layer.weight.device.type == "meta"
    # The tied head and the embedding share one quantized table; no dense copy stays.
    assert model.lm_head.quant_weight is model.model.embed_tokens.quant_table
    assert model.model.embed_tokens.weight.device.type == "meta"
    resident = sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)
    tables = {
        id(held): held
        for m in model.modules()
        for held in (getattr(m, "quant_weight", None), getattr(m, "quant_table", None))
        if isinstance(held, QuantizedWeight)
    }
    quantized = sum(t.nbytes for t in tables.values())
    dense = sum(p.numel() * 2 for p in model.parameters())  # bf16 bytes of every weight
    # int4 with offsets in groups of 64 is 36 bytes per 64 weights (28%); the norms stay dense.
    assert quantized > 0 and resident + quantized < 0.30 * dense
    ids = torch.tensor([[3, 17], [250, 3]])
    looked_up = model.model.embed_tokens(ids)
    table = model.model.embed_tokens.quant_table.dequantize(torch.float32)
    assert torch.equal(looked_up, table[ids].to(torch.bfloat16))


@pytest.mark.parametrize(
    ("qtype", "bits"), [(gguf.GGMLQuantizationType.Q8_0, 8), (gguf.GGMLQuantizationType.Q4_0, 4)]
)
def test_gguf_layers_keep_the_files_integers(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, qtype: Any, bits: int
) -> None:
    monkeypatch.setenv("TOKENWISE_GGUF_CACHE", str(tmp_path / "tokenizers"))
    hf_dir = build_tiny_checkpoint(tmp_path, "Qwen2ForCausalLM", **SHAPE)
    path = write_gguf(hf_dir, str(tmp_path / "model.gguf"), qtype)
    config = ModelConfig.from_pretrained(path, dtype="float32", skip_tokenizer_init=True)
    assert config.quantization == "gguf"
    model = load_model(EngineConfig(model=config))
    layer = model.model.layers[0].mlp.down_proj
    packed = layer.quant_weight
    assert isinstance(packed, QuantizedWeight) and packed.bits == bits
    assert packed.gguf_file  # float32 activations: int8 by default, as llama.cpp
    reader = gguf.GGUFReader(path)
    tensor = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    blocks = tensor.data.reshape(packed.shape[0], -1, 34 if bits == 8 else 18)
    assert torch.equal(
        packed.scales, torch.from_numpy(blocks[..., :2].copy().view("float16"))[..., 0]
    )
    data = torch.from_numpy(blocks[..., 2:].reshape(packed.shape[0], -1).copy())
    assert torch.equal(packed.qweight, data.view(torch.int8) if bits == 8 else data)


def test_bad_quantization_settings_name_the_field(tmp_path: Any) -> None:
    path = _checkpoint(tmp_path)
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(path, quantization="int3")
    with pytest.raises(ValueError, match="quantization='bitsandbytes' is not built yet"):
        LLM(path, quantization="bitsandbytes")
    with pytest.raises(ValueError, match="quantization='gptq' needs a checkpoint quantized"):
        LLM(path, quantization="gptq")
    with pytest.raises(ValueError, match="quantization='gguf' needs a .gguf"):
        LLM(path, quantization="gguf")
    with pytest.raises(ValueError, match="enforce_eager"):
        LLM(path, quantization="int8", enforce_eager=False)
    with pytest.raises(ValueError, match="runs on CPU and CUDA devices only"):
        resolve_quantization("int4", None, "auto", "mps")


def test_checkpoint_with_an_unsupported_quantization_config_is_refused_by_name(
    tmp_path: Any,
) -> None:
    """GPTQ, AWQ and compressed-tensors load (tests/quantization/test_gptq_awq.py and
    test_compressed_tensors.py); other formats are refused naming their quant_method."""
    config = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    path = _checkpoint(tmp_path, quantization_config=config)
    with pytest.raises(ValueError, match="quant_method='bitsandbytes'"):
        LLM(path)
    assert resolve_quantization(None, _Config({"quant_method": "awq", "bits": 4}), "auto", "cpu")
    assert (
        resolve_quantization(None, _Config({"quant_method": "awq", "bits": 4}), "auto", "cuda")
        == "awq"
    )


class _Config:
    def __init__(self, quantization_config: dict[str, Any]) -> None:
        self.quantization_config = quantization_config


def test_lora_on_a_quantized_base_equals_peft_on_its_dequantized_weights(tmp_path: Any) -> None:
    """Adapters add their delta to the quantized layer's output: the same tokens as PEFT's
    adapter over transformers holding the dequantized weights, mixed with base requests."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    from tokenwise import LoRARequest

    path = _checkpoint(tmp_path)
    reference = _dequantized_copy(path, str(tmp_path / "dequantized"), *SCHEMES["int8"])
    torch.manual_seed(0)
    targets = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    adapter = str(tmp_path / "adapter")
    get_peft_model(model, config).save_pretrained(adapter)

    llm = LLM(path, dtype="float32", quantization="int8", enable_lora=True, max_lora_rank=4)
    prompts = mixed_prompts()[:4]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    lora = LoRARequest("a", 1, adapter)
    outputs = llm.generate(
        prompts * 2, params, use_tqdm=False, lora_request=[lora] * 4 + [None] * 4
    )
    peft = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32), adapter
    ).eval()
    for prompt, out in zip(prompts, outputs[:4], strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            want = peft.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, pad_token_id=0,
            )  # fmt: skip
        assert out.outputs[0].token_ids == want[0, len(prompt) :].tolist()
    for prompt, out in zip(prompts, outputs[4:], strict=True):
        assert out.outputs[0].token_ids == hf_greedy(reference, prompt, MAX_TOKENS)
    assert [o.outputs[0].token_ids for o in outputs[:4]] != [
        o.outputs[0].token_ids for o in outputs[4:]
    ]
