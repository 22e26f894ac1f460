"""GGUF files load into tokenwise and compute what transformers computes from the same file.

The files are written in the test from tiny HF checkpoints (`_gguf_files.py`: llama.cpp's
layout, gguf-py's writer and numpy quantizers). Reference: transformers loading the same
`.gguf` (`from_pretrained(dir, gguf_file=...)`), which dequantizes with the same gguf-py
functions, so both hold bitwise-identical weights and the only difference left is fp32 kernel
order: the repo's HF parity bar, 1e-4 on logits, applies unchanged at every quantization.
Separately, an F32 file must give bitwise the logits of the safetensors checkpoint it was
written from (loaded by tokenwise): that proves the name mapping and the q/k un-permutation
independently of any quantization error (a wrong permutation moves logits by O(1)).
"""

from __future__ import annotations

import os
from typing import Any

import gguf
import pytest
import torch

from tests.quantization._gguf_files import write_gguf
from tests.tiny_checkpoints import CHAT_TEMPLATE, build_tiny_checkpoint, tiny_tokenizer
from tokenwise import LLM, SamplingParams
from tokenwise.config import EngineConfig
from tokenwise.loader import load_model
from tokenwise.model_config import ModelConfig
from tokenwise.native import qgemv as cpu_qgemv

pytestmark = pytest.mark.usefixtures("exact_fp32_activations")  # compared with transformers

Q = gguf.GGMLQuantizationType
ATOL = 1e-4  # fp32 kernel-order differences only (see the module docstring)
SEQ_LEN = 24
# transformers' GGUF reader leaves Qwen3's head_dim at its class default (128), so the tiny
# Qwen3 uses that width; tokenwise reads it from the file's attention.key_length.
ARCHS = {
    "llama": ("LlamaForCausalLM", {}),
    "qwen2": ("Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3ForCausalLM", {"head_dim": 128}),
}
# K-quant blocks hold 256 values, so those files need rows of 256: a wider tiny model.
WIDE = {"hidden_size": 256, "intermediate_size": 256}
PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):",
    "Hello world! Hello",
    "Paged attention stores keys",
    "Once upon a time there was",
    "import os\nimport",
]
MAX_TOKENS = 12


@pytest.fixture(autouse=True)
def _tokenizer_cache(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENWISE_GGUF_CACHE", str(tmp_path / "tokenizers"))


def _files(tmp_path: Any, arch: str, qtype: Any, **extra: Any) -> tuple[str, str]:
    cls, overrides = ARCHS[arch]
    hf_dir = build_tiny_checkpoint(tmp_path, cls, **overrides, **extra)
    path = write_gguf(hf_dir, str(tmp_path / f"{arch}-{qtype.name}.gguf"), qtype)
    return hf_dir, path


def _ids() -> torch.Tensor:
    return torch.randint(2, 300, (SEQ_LEN,), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def _our_logits(model: str, ids: torch.Tensor) -> torch.Tensor:
    config = ModelConfig.from_pretrained(model, dtype="float32", skip_tokenizer_init=True)
    net = load_model(EngineConfig(model=config))
    return net.compute_logits(net(ids, torch.arange(ids.numel())))


def _hf_gguf_model(path: str) -> Any:
    from transformers import AutoModelForCausalLM

    directory, name = os.path.split(path)
    return AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=torch.float32
    ).eval()


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0], ids=lambda q: q.name)
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_logits_match_hf_loading_the_same_gguf(tmp_path: Any, arch: str, qtype: Any) -> None:
    _assert_matches_hf(_files(tmp_path, arch, qtype)[1])


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda q: q.name)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_k_quant_logits_match_hf(tmp_path: Any, arch: str, qtype: Any) -> None:
    """Random valid K-quant blocks (gguf-py cannot quantize to K types): both sides dequantize
    the same blocks, so the 1e-4 bar holds."""
    _assert_matches_hf(_files(tmp_path, arch, qtype, **WIDE)[1])


def test_mixed_k_quant_file_keeps_every_part_quantized(tmp_path: Any) -> None:
    """A Q4_K_M-style file: q, k, gate, up in Q4_K, v and down in Q6_K. Every layer keeps its
    file's integers (float32 scales: K-quant scales are products float16 does not hold), the
    fused q/k/v as per-part formats, and the logits still match HF's dequantization."""
    from tokenwise.layers.quantization.weight_only import QuantizedParts, QuantizedWeight

    hf_dir = build_tiny_checkpoint(tmp_path, "LlamaForCausalLM", **WIDE)
    mix = {"attn_v": Q.Q6_K, "ffn_down": Q.Q6_K}
    path = write_gguf(hf_dir, str(tmp_path / "mixed.gguf"), Q.Q4_K, types=mix)
    _assert_matches_hf(path)
    config = ModelConfig.from_pretrained(path, dtype="float32", skip_tokenizer_init=True)
    layer = load_model(EngineConfig(model=config)).model.layers[0]
    qkv = layer.self_attn.qkv_proj.quant_weight
    assert isinstance(qkv, QuantizedParts)
    assert [(p.bits, p.group_size) for p in qkv.parts] == [(4, 32), (4, 32), (8, 16)]
    gate_up, down = layer.mlp.gate_up_proj.quant_weight, layer.mlp.down_proj.quant_weight
    assert isinstance(gate_up, QuantizedWeight) and gate_up.bits == 4
    assert gate_up.scales.dtype == torch.float32 and gate_up.offsets is not None
    assert isinstance(down, QuantizedWeight) and (down.bits, down.group_size) == (8, 16)
    assert int(down.qweight.min()) >= -32 and int(down.qweight.max()) <= 31  # Q6_K's range


def _assert_matches_hf(path: str) -> None:
    ids = _ids()
    ours = _our_logits(path, ids)
    with torch.no_grad():
        reference = _hf_gguf_model(path)(ids[None]).logits[0]
    assert reference.std() > 0.1  # the weights decode to a model that discriminates tokens
    torch.testing.assert_close(ours, reference, atol=ATOL, rtol=0)
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_default_int8_activations_cost_less_than_the_files_rounding(
    tmp_path: Any, arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """By default (not this module's exact setting) a Q8_0 file's layers multiply float32
    activations as int8 per 32 values, as llama.cpp does: the logits leave transformers' (which
    multiplies the dequantized file in float32) by more than kernel order, but by less than
    Q8_0's own weight rounding moves them from the float32 checkpoint the file was made of."""
    monkeypatch.setenv(cpu_qgemv.FP32_ACTIVATIONS_ENV, "auto")
    cpu_qgemv.fp32_activation_bits.cache_clear()
    from transformers import AutoModelForCausalLM

    hf_dir, path = _files(tmp_path, arch, Q.Q8_0)
    ids = _ids()
    ours = _our_logits(path, ids)
    cpu_qgemv.fp32_activation_bits.cache_clear()
    with torch.no_grad():
        from_file = _hf_gguf_model(path)(ids[None]).logits[0]
        dense = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        unrounded = dense(ids[None]).logits[0]
    activations_error = (ours - from_file).abs().max()
    assert ATOL * 10 < activations_error < (from_file - unrounded).abs().max()


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_f32_gguf_round_trips_to_the_checkpoint_exactly(tmp_path: Any, arch: str) -> None:
    hf_dir, path = _files(tmp_path, arch, Q.F32)
    ids = _ids()
    assert torch.equal(_our_logits(path, ids), _our_logits(hf_dir, ids))


def test_quantization_error_is_real_and_ordered(tmp_path: Any) -> None:
    """Guards the parity tests against a writer that silently stored F32: Q8_0 must move the
    logits off the F32 file's, and Q4_0 (4 bits) by more than Q8_0 (8 bits)."""
    ids = _ids()
    exact = _our_logits(_files(tmp_path, "llama", Q.F32)[1], ids)
    q8 = (_our_logits(_files(tmp_path, "llama", Q.Q8_0)[1], ids) - exact).abs().max()
    q4 = (_our_logits(_files(tmp_path, "llama", Q.Q4_0)[1], ids) - exact).abs().max()
    assert 1e-3 < q8 < q4


@torch.no_grad()
def _hf_greedy(model: Any, ids: list[int], steps: int) -> list[int]:
    out = list(ids)
    for _ in range(steps):
        out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids) :]


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0], ids=lambda q: q.name)
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_greedy_generation_matches_hf(tmp_path: Any, arch: str, qtype: Any) -> None:
    """The engine end to end on a GGUF file, tokenizer converted from the file's metadata:
    the same tokenization as the original tokenizer, and HF's greedy tokens on all 6 prompts."""
    _, path = _files(tmp_path, arch, qtype)
    llm = LLM(path, dtype="float32", num_gpu_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params)
    hf = _hf_gguf_model(path)
    original = tiny_tokenizer()
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        assert output.prompt_token_ids == original.encode(prompt)
        assert output.outputs[0].token_ids == _hf_greedy(hf, output.prompt_token_ids, MAX_TOKENS)


def test_chat_template_comes_from_the_file(tmp_path: Any) -> None:
    hf_dir = build_tiny_checkpoint(tmp_path, "LlamaForCausalLM")
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    assert template != CHAT_TEMPLATE
    path = write_gguf(hf_dir, str(tmp_path / "chat.gguf"), Q.Q8_0, chat_template=template)
    for tokenizer_dir in (None, hf_dir):  # from the metadata, and over a given directory
        llm = LLM(path, tokenizer=tokenizer_dir, dtype="float32", num_gpu_blocks=64)
        assert llm.get_tokenizer().chat_template == template
        messages = [{"role": "user", "content": "hi"}]
        assert llm.get_tokenizer().apply_chat_template(messages, tokenize=False) == "[hi]"


# Llama 3.2's rope (theta 500000, llama3 scaling by 32 from an 8192 context) and tied
# embeddings. llama.cpp stores the scaling as a `rope_freqs` tensor (one factor per pair).
LLAMA32 = {
    "rope_parameters": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": True,
    "max_position_embeddings": 131072,
}


def _llama32_files(tmp_path: Any, qtype: Any) -> tuple[str, str]:
    """A Llama-3.2-shaped GGUF file and, as the reference, the checkpoint holding the
    file's (dequantized) weights with the original config (llama3 rope scaling)."""
    hf_dir = build_tiny_checkpoint(tmp_path, "LlamaForCausalLM", **LLAMA32)
    dense = str(tmp_path / f"dense-{qtype.name}")
    path = write_gguf(hf_dir, str(tmp_path / f"llama32-{qtype.name}.gguf"), qtype, dense_dir=dense)
    return dense, path


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0], ids=lambda q: q.name)
def test_llama3_rope_factors_give_hf_logits_and_greedy_tokens(tmp_path: Any, qtype: Any) -> None:
    """The file's `rope_freqs` divide the inverse frequencies: logits equal transformers'
    llama3 rope on the same weights (1e-4), and the engine generates its greedy tokens."""
    from transformers import AutoModelForCausalLM

    dense, path = _llama32_files(tmp_path, qtype)
    ids = torch.randint(2, 300, (96,), generator=torch.Generator().manual_seed(0))
    hf = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = hf(ids[None]).logits[0]
    torch.testing.assert_close(_our_logits(path, ids), reference, atol=ATOL, rtol=0)
    llm = LLM(path, dtype="float32", num_gpu_blocks=64, max_model_len=512)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for output in llm.generate(PROMPTS, params, use_tqdm=False):
        assert output.outputs[0].token_ids == _hf_greedy(hf, output.prompt_token_ids, MAX_TOKENS)


def test_llama3_rope_factors_change_the_logits(tmp_path: Any) -> None:
    """Guards the test above: the same weights without the scaling (HF's plain rope) give
    logits far off, so a loader that dropped the factors would fail it."""
    from transformers import AutoModelForCausalLM

    dense, path = _llama32_files(tmp_path, Q.F32)
    ids = torch.randint(2, 300, (96,), generator=torch.Generator().manual_seed(0))
    plain = {"rope_type": "default", "rope_theta": 500000.0}
    hf = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32, rope_parameters=plain)
    with torch.no_grad():
        unscaled = hf.eval()(ids[None]).logits[0]
    assert (_our_logits(path, ids) - unscaled).abs().max() > 100 * ATOL
