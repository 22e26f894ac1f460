"""compressed-tensors checkpoints load into tokenwise and compute what their weights say.

The checkpoints are written here with the `compressed-tensors` package itself: its qparams
(`calculate_qparams`) and compressors (`pack-quantized`, `int-quantized`, `float-quantized`)
over a tiny float Llama, and its `QuantizationConfig` as config.json's `quantization_config`,
as llm-compressor saves them. References:
- transformers loading a float checkpoint of the package's own decompressed weights
  (`Compressor.decompress`, float32): tokenwise holds the same weights (W4A16 and int8 exactly
  as `(q - z) * s` in float32, within one float32 rounding of `-z * s` for asymmetric float32
  scales; FP8 through the package's decompressor itself), so the only difference left is fp32
  kernel order and the bar is the repo's 1e-4 on logits and the same greedy tokens;
- for W4A16, transformers loading the compressed checkpoint directly (it decompresses with the
  package), the same 1e-4.
W8A8 int8 and FP8 quantize activations too; tokenwise runs them weight-only on CPU (activations
in floating point; FP8 layers keep their float8 weights, `fp8`), so their reference is the
weight-only model, the decompressed checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.engine._fixtures import hf_greedy, hf_model, mixed_prompts
from tests.tiny_checkpoints import build_tiny_checkpoint
from tokenwise import LLM, SamplingParams
from tokenwise.config import EngineConfig
from tokenwise.layers.quantization.fp8 import FP8Weight
from tokenwise.layers.quantization.weight_only import QuantizedWeight, unpack_int4
from tokenwise.loader import load_model
from tokenwise.model_config import ModelConfig

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import BaseCompressor  # noqa: E402
from compressed_tensors.quantization import (  # noqa: E402
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
)
from compressed_tensors.quantization.utils.helpers import calculate_qparams  # noqa: E402

SHAPE = {"hidden_size": 64, "intermediate_size": 128}
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATOL = 1e-4  # fp32 kernel order only (see the module docstring)
MAX_TOKENS = 8
DYNAMIC_TOKENS = {"num_bits": 8, "symmetric": True, "strategy": "token", "dynamic": True}
# name: (format, weight args, input activation args or None)
CASES: dict[str, tuple[str, dict[str, Any], dict[str, Any] | None]] = {
    "w4a16-sym": (
        "pack-quantized",
        {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32},
        None,
    ),
    "w4a16-asym": (
        "pack-quantized",
        {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 32},
        None,
    ),
    "w8a16-channel": (
        "pack-quantized",
        {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
        None,
    ),
    "w8a8-int8": (
        "int-quantized",
        {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
        {"type": "int", **DYNAMIC_TOKENS},
    ),
    "w8a8-int8-asym-tensor": (
        "int-quantized",
        {"num_bits": 8, "type": "int", "symmetric": False, "strategy": "tensor"},
        {"type": "int", **DYNAMIC_TOKENS},
    ),
    "fp8-static": (
        "float-quantized",
        {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"},
        {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor"},
    ),
}


def _checkpoints(tmp_path: Any, case: str) -> tuple[str, str]:
    """(the compressed checkpoint, a float one of the package's decompressed weights)."""
    fmt, weight_args, input_args = CASES[case]
    args = QuantizationArgs(**weight_args)
    inputs = QuantizationArgs(**input_args) if input_args else None
    scheme = QuantizationScheme(targets=["Linear"], weights=args, input_activations=inputs)
    compressor = BaseCompressor.get_value_from_registry(fmt)
    dense = build_tiny_checkpoint(tmp_path, "LlamaForCausalLM", **SHAPE)
    compressed, reference = str(tmp_path / case), str(tmp_path / "reference")
    shutil.copytree(dense, compressed)
    shutil.copytree(dense, reference)
    state = load_file(os.path.join(dense, "model.safetensors"))
    packed, exact = {}, {}
    for name, w in state.items():
        layer = name.removesuffix(".weight")
        if not (name.endswith(".weight") and layer.split(".")[-1] in LINEAR):
            packed[name] = exact[name] = w
            continue
        width = {"group": args.group_size, "channel": w.shape[1]}.get(str(args.strategy))
        blocks = w.float().reshape(w.shape[0], -1, width) if width else w.float().reshape(1, -1)
        scale, zero = calculate_qparams(blocks.amin(-1), blocks.amax(-1), args)
        module = {"weight": w.float(), "weight_scale": scale, "weight_zero_point": zero}
        if case == "fp8-static":  # a static activation scale, which tokenwise ignores
            module["input_scale"] = torch.tensor([0.05])
        module = compressor.compress(module, scheme)
        packed.update({f"{layer}.{key}": value for key, value in module.items()})
        exact[name] = compressor.decompress(module, scheme)["weight"].float()
    config = QuantizationConfig(
        config_groups={"group_0": scheme},
        format=fmt,
        quantization_status="compressed",
        ignore=["lm_head"],
    )
    _write(compressed, packed, config.to_dict())
    _write(reference, exact)
    return compressed, reference


def _write(path: str, state: dict[str, torch.Tensor], quantization_config: Any = None) -> None:
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    if quantization_config is not None:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        config["quantization_config"] = quantization_config
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f)


def _load(path: str, **kwargs: Any) -> Any:
    config = ModelConfig.from_pretrained(path, dtype="float32", skip_tokenizer_init=True, **kwargs)
    return load_model(EngineConfig(model=config))


def _ids() -> torch.Tensor:
    return torch.randint(2, 300, (24,), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def _logits(path: str, ids: torch.Tensor) -> torch.Tensor:
    net = _load(path)
    return net.compute_logits(net(ids, torch.arange(ids.numel())))


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_hf_on_the_decompressed_weights(tmp_path: Any, case: str) -> None:
    compressed, reference = _checkpoints(tmp_path, case)
    ids = _ids()
    ours = _logits(compressed, ids)
    with torch.no_grad():
        expected = hf_model(reference)(ids[None]).logits[0]
    torch.testing.assert_close(ours, expected, atol=ATOL, rtol=0)
    assert torch.equal(ours.argmax(-1), expected.argmax(-1))
    dense = build_tiny_checkpoint(tmp_path / "float", "LlamaForCausalLM", **SHAPE)
    assert (ours - _logits(dense, ids)).abs().max() > 1e-3  # the weights really were quantized


@pytest.mark.parametrize("case", ["w4a16-sym", "w8a16-channel"])
def test_logits_match_hf_loading_the_compressed_checkpoint(tmp_path: Any, case: str) -> None:
    """transformers reads these with the package directly. (Asymmetric pack-quantized it does
    not load in this transformers version: its model expects unpacked zero points.)"""
    from transformers import AutoModelForCausalLM

    compressed, _ = _checkpoints(tmp_path, case)
    ids = _ids()
    model = AutoModelForCausalLM.from_pretrained(compressed, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = model(ids[None]).logits[0]
    torch.testing.assert_close(_logits(compressed, ids), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    ("case", "bits", "symmetric"),
    [("w4a16-asym", 4, False), ("w4a16-sym", 4, True), ("w8a8-int8", 8, True)],
)
def test_layers_hold_the_checkpoints_integers(
    tmp_path: Any, case: str, bits: int, symmetric: bool
) -> None:
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    compressed, _ = _checkpoints(tmp_path, case)
    model = _load(compressed)
    assert model.lm_head.quant_weight is None  # ignored by the config: float, kept dense
    layer = model.model.layers[1].mlp.down_proj
    packed = layer.quant_weight
    assert isinstance(packed, QuantizedWeight) and layer.weight.is_meta
    assert packed.bits == bits and (packed.offsets is None) == symmetric
    state = load_file(os.path.join(compressed, "model.safetensors"))
    prefix = "model.layers.1.mlp.down_proj"
    if bits == 4:
        q = unpack_from_int32(state[f"{prefix}.weight_packed"], 4, torch.Size(packed.shape))
        assert torch.equal(unpack_int4(packed.qweight).long() - 8, q.long())
    else:
        assert torch.equal(packed.qweight, state[f"{prefix}.weight"])
    assert torch.equal(packed.scales.float(), state[f"{prefix}.weight_scale"])


def test_fp8_layers_keep_the_checkpoints_fp8_values(tmp_path: Any, monkeypatch: Any) -> None:
    """FP8 layers hold the file's float8 weights and channel scales (q/k/v stacked), computing
    what their dense form computes; `TOKENWISE_CPU_FP8_WEIGHTS=dense` gives that form."""
    compressed, _ = _checkpoints(tmp_path, "fp8-static")
    monkeypatch.setenv("TOKENWISE_CPU_FP8_WEIGHTS", "fp8")
    layer = _load(compressed).model.layers[0].self_attn.qkv_proj
    assert isinstance(layer.quant_weight, FP8Weight) and layer.weight.is_meta
    state = load_file(os.path.join(compressed, "model.safetensors"))
    parts = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    weights = torch.cat([state[f"{p}.weight"].view(torch.uint8) for p in parts])
    assert torch.equal(layer.quant_weight.weight.view(torch.uint8), weights)
    assert torch.equal(
        layer.quant_weight.scale, torch.cat([state[f"{p}.weight_scale"] for p in parts])
    )
    monkeypatch.setenv("TOKENWISE_CPU_FP8_WEIGHTS", "dense")
    dense = _load(compressed).model.layers[0].self_attn.qkv_proj
    assert dense.quant_weight is None and not dense.weight.is_meta
    assert torch.equal(dense.weight, layer.quant_weight.dequantize())


@pytest.mark.parametrize("case", ["w4a16-asym", "w8a8-int8"])
def test_engine_gives_hf_greedy_tokens(tmp_path: Any, case: str) -> None:
    """Through `LLM(...)` (chunked prefill, decode batches of 1 to 6 rows): HF's greedy tokens
    on the decompressed weights, on all 18 prompts."""
    compressed, reference = _checkpoints(tmp_path, case)
    llm = LLM(compressed, dtype="float32", num_gpu_blocks=64, max_num_batched_tokens=16)
    assert llm.llm_engine.model_config.quantization == "compressed-tensors"
    prompts = mixed_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(reference, prompt, MAX_TOKENS)


def _edit_config(path: str, edit: Any) -> str:
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    edit(config["quantization_config"])
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def _weights(qc: dict[str, Any]) -> dict[str, Any]:
    return qc["config_groups"]["group_0"]["weights"]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda qc: qc.update(format="marlin-24"), "format='marlin-24' is not supported"),
        (lambda qc: _weights(qc).update(num_bits=3), "num_bits=3 is not supported"),
        (lambda qc: _weights(qc).update(strategy="block", group_size=None), "strategy="),
        (
            lambda qc: qc.update(kv_cache_scheme={"num_bits": 8, "type": "float"}),
            "kv_cache_scheme",
        ),
        (lambda qc: qc.update(config_groups=5), "quantization_config is not valid"),
    ],
    ids=["format", "num_bits", "strategy", "kv_cache_scheme", "config_groups"],
)
def test_bad_configs_name_the_field(tmp_path: Any, edit: Any, message: str) -> None:
    compressed = _edit_config(_checkpoints(tmp_path, "w4a16-sym")[0], edit)
    with pytest.raises(ValueError, match=message):
        _load(compressed)
    with pytest.raises(ValueError, match="quantization='gptq' does not match"):
        _load(compressed, quantization="gptq")
