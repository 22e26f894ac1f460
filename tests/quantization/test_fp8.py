"""FP8 weights: block-scaled "fp8" checkpoints, `quantization="fp8"` on load, the W8A8 product.

Checkpoints are written here in HF transformers' fine-grained FP8 layout (DeepSeek-V3's):
each linear layer's `weight` float8_e4m3fn and `weight_scale_inv` float32, one scale per
[128, 128] tile (amax / 448), config.json's `quantization_config` {"quant_method": "fp8", ...};
embeddings, norms and the LM head stay float. References:
- transformers loading the very directory: on CPU it dequantizes to the model's dtype itself
  (`dequantize=True` is forced without a GPU). Its dequantizer derives the tile size from
  `shape // scale grid`, which is right only where each dimension is a multiple of 128 or
  smaller than 128, so that model has such sizes (hidden 128, intermediate 384, K/V 64 rows);
- with partial tiles (hidden 192, intermediate 320), transformers on a float checkpoint of the
  dense weights computed here from the definition (`q * scale` of its tile, float32).
Both hold the same float32 weights as tokenwise, so the bar is the repo's fp32 1e-4 on logits
and the same argmax at every position.
"""

from __future__ import annotations

import json
import math
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
from tokenwise.layers.quantization.fp8 import (
    FP8_DTYPE,
    FP8Weight,
    quantize_fp8,
    scaled_linear,
)
from tokenwise.layers.quantization.fp8_loading import _cut
from tokenwise.loader import load_model
from tokenwise.model_config import ModelConfig
from tokenwise.native import fp8_gemv as cpu_fp8

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FULL_TILES = {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2}
PARTIAL_TILES = {"hidden_size": 192, "intermediate_size": 320, "num_hidden_layers": 2}
ATOL = 1e-4


def quantize_blocks(w: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The published layout, from its definition: per [bn, bk] tile, scale = amax / 448."""
    n, k = w.shape
    scale = torch.empty(math.ceil(n / bn), math.ceil(k / bk))
    q = torch.empty(n, k, dtype=FP8_DTYPE)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk].float()
            s = tile.abs().max().clamp(min=1e-12) / 448.0
            scale[i, j] = s
            q[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = (tile / s).to(FP8_DTYPE)
    return q, scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    out = q.float().clone()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] *= scale[i, j]
    return out


def write_fp8(tmp_path: Any, arch: str, shape: dict[str, int], **qc: Any) -> tuple[str, str]:
    """(the block-FP8 checkpoint, a float32 one of its dense weights)."""
    dense = build_tiny_checkpoint(tmp_path, arch, **shape)
    fp8, reference = str(tmp_path / "fp8"), str(tmp_path / "reference")
    shutil.copytree(dense, fp8)
    shutil.copytree(dense, reference)
    state = load_file(os.path.join(dense, "model.safetensors"))
    packed, exact = {}, {}
    for name, w in state.items():
        layer = name.removesuffix(".weight")
        if not (name.endswith(".weight") and layer.split(".")[-1] in LINEAR):
            packed[name], exact[name] = w, w.float()
            continue
        q, s = quantize_blocks(w, 128, 128)
        packed[name], packed[f"{layer}.weight_scale_inv"] = q, s
        exact[name] = dequantize_blocks(q, s, 128, 128)
    config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    config.update({"weight_block_size": [128, 128], **qc})
    _write(fp8, packed, config)
    _write(reference, exact)
    return fp8, reference


def _write(path: str, state: dict[str, torch.Tensor], qc: dict[str, Any] | None = None) -> None:
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    if qc is not None:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        config["quantization_config"] = qc
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f)


def _load(path: str, dtype: str = "float32", **kwargs: Any) -> Any:
    config = ModelConfig.from_pretrained(path, dtype=dtype, skip_tokenizer_init=True, **kwargs)
    return load_model(EngineConfig(model=config))


def _ids() -> torch.Tensor:
    return torch.randint(2, 300, (24,), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def _logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    return model.compute_logits(model(ids, torch.arange(ids.numel()))).float()


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_block_fp8_checkpoint_matches_hf_loading_it(tmp_path: Any, arch: str) -> None:
    fp8, _ = write_fp8(tmp_path, arch, FULL_TILES)
    ids = _ids()
    ours = _logits(_load(fp8), ids)
    with torch.no_grad():
        expected = hf_model(fp8)(ids[None]).logits[0]
    torch.testing.assert_close(ours, expected, atol=ATOL, rtol=0)
    assert torch.equal(ours.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_partial_tiles_match_hf_on_the_dense_weights(tmp_path: Any, arch: str) -> None:
    fp8, reference = write_fp8(tmp_path, arch, PARTIAL_TILES)
    ids = _ids()
    ours = _logits(_load(fp8), ids)
    with torch.no_grad():
        expected = hf_model(reference)(ids[None]).logits[0]
    torch.testing.assert_close(ours, expected, atol=ATOL, rtol=0)
    assert torch.equal(ours.argmax(-1), expected.argmax(-1))
    dense = build_tiny_checkpoint(tmp_path / "float", arch, **PARTIAL_TILES)
    assert (ours - _logits(_load(dense), ids)).abs().max() > 1e-3  # really quantized


def test_moe_experts_are_dequantized_at_load(tmp_path: Any) -> None:
    """A Qwen3-MoE FP8 checkpoint (each expert's projections block-scaled; the router float):
    the experts load dequantized (`FusedMoE` has no FP8 path), attention and dense layers
    keep fp8, and the logits are HF's on the dense weights."""
    fp8, reference = write_fp8(tmp_path, "Qwen3MoeForCausalLM", {"hidden_size": 128})
    model = _load(fp8)
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.o_proj.quant_weight, FP8Weight)
    assert layer.mlp.experts.w13_weight.dtype == torch.float32
    ids = _ids()
    with torch.no_grad():
        expected = hf_model(reference)(ids[None]).logits[0]
    torch.testing.assert_close(_logits(model, ids), expected, atol=ATOL, rtol=0)


def test_engine_gives_hf_greedy_tokens(tmp_path: Any) -> None:
    """Through `LLM(...)` (chunked prefill, decode batches): HF's greedy tokens on the dense
    weights, on all of 6 prompts of 1 to 95 tokens (the same float32 weights: no reason for
    any token to differ)."""
    fp8, reference = write_fp8(tmp_path, "Qwen3ForCausalLM", PARTIAL_TILES)
    llm = LLM(fp8, dtype="float32", num_gpu_blocks=64, max_num_batched_tokens=16)
    assert llm.llm_engine.model_config.quantization == "fp8"
    prompts = mixed_prompts()[::3]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(reference, prompt, 8)


def test_layers_keep_the_checkpoints_fp8_bytes(tmp_path: Any, monkeypatch: Any) -> None:
    """With `TOKENWISE_CPU_FP8_WEIGHTS=fp8` a layer holds the file's own fp8 values and scales,
    and computes (24 rows: the weight dequantized per call) what the dense-on-CPU form does."""
    fp8, _ = write_fp8(tmp_path, "LlamaForCausalLM", PARTIAL_TILES)
    state = load_file(os.path.join(fp8, "model.safetensors"))
    ids = _ids()
    monkeypatch.setenv("TOKENWISE_CPU_FP8_WEIGHTS", "dense")
    dense = _load(fp8, "bfloat16")
    layer = dense.model.layers[1].mlp.down_proj
    assert layer.quant_weight is None and layer.weight.dtype == torch.bfloat16  # plain dense
    dense_logits = _logits(dense, ids)
    monkeypatch.setenv("TOKENWISE_CPU_FP8_WEIGHTS", "fp8")
    model = _load(fp8, "bfloat16")
    down = model.model.layers[1].mlp.down_proj
    assert isinstance(down.quant_weight, FP8Weight) and down.weight.is_meta
    prefix = "model.layers.1.mlp.down_proj"
    assert torch.equal(
        down.quant_weight.weight.view(torch.uint8), state[f"{prefix}.weight"].view(torch.uint8)
    )
    assert torch.equal(down.quant_weight.scale, state[f"{prefix}.weight_scale_inv"])
    assert model.lm_head.quant_weight is None  # not in the file as fp8: stays dense
    # The same bf16 weights; the dense layers may take another bf16 matmul (oneDNN's prepacked
    # one), so a bf16 rounding of the logits (0.03 at 4) may differ.
    torch.testing.assert_close(_logits(model, ids), dense_logits, atol=0.05, rtol=0)


def test_quantization_fp8_on_load(tmp_path: Any, monkeypatch: Any) -> None:
    """Per-tensor fp8 of a bf16 model: linear weights in float8 (half bf16's bytes, plus one
    scale each); logits within 20% (relative L2) of the bf16 model's. Why that bar: e4m3 keeps
    3 mantissa bits (each weight rounded by up to 1/16, ~2% rms, 32x bf16's), and this tiny
    model's std-0.2 weights amplify errors through its layers: measured 13% (bf16 against
    float32: 2.4%; an unrelated random model: >100%)."""
    path = build_tiny_checkpoint(tmp_path, "LlamaForCausalLM", **FULL_TILES)
    ids = _ids()
    reference = _logits(_load(path, "bfloat16"), ids)
    monkeypatch.setenv("TOKENWISE_CPU_FP8_WEIGHTS", "dense")
    dense = _logits(_load(path, "bfloat16", quantization="fp8"), ids)
    monkeypatch.setenv("TOKENWISE_CPU_FP8_WEIGHTS", "fp8")
    model = _load(path, "bfloat16", quantization="fp8")
    ours = _logits(model, ids)
    fp8_bytes = dense_bytes = 0
    for name, module in model.named_modules():
        if name.rpartition(".")[2] in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            packed = module.quant_weight
            assert packed.weight.dtype == FP8_DTYPE and packed.kind == "tensor"
            fp8_bytes += packed.nbytes
            dense_bytes += module.weight.numel() * 2
    assert fp8_bytes == dense_bytes // 2 + 4 * 4 * 2  # one float32 scale per layer
    relative = ((ours - reference).norm() / reference.norm()).item()
    assert 0 < relative < 0.2
    torch.testing.assert_close(dense, ours, atol=0.05, rtol=0)  # the same weights, dense


def _reference_w8a8(x: torch.Tensor, w: FP8Weight, group: int | None) -> torch.Tensor:
    """From the definition: x per token (per `group` columns) to e4m3 with scale amax / 448,
    both operands times their scales, the product in float64."""
    k = x.shape[1]
    width = group or k
    xs = torch.empty_like(x, dtype=torch.float64)
    for j in range(0, k, width):
        part = x[:, j : j + width].double()
        s = part.abs().amax(1, keepdim=True) / 448.0
        xs[:, j : j + width] = (part / s).to(FP8_DTYPE).double() * s
    return xs @ w.dequantize(torch.float64).t()


@pytest.mark.parametrize("kind", ["tensor", "channel"])
def test_scaled_mm_matches_the_definition(kind: str) -> None:
    """`scaled_linear` (the CUDA path, here through torch's CPU `_scaled_mm`) against the
    definition; float32 output, so the bar is fp32 summation order (1e-4 relative)."""
    g = torch.Generator().manual_seed(1)
    w = quantize_fp8(torch.randn(96, 160, generator=g), per_channel=kind == "channel")
    x = torch.randn(5, 160, generator=g)
    bias = torch.randn(96, generator=g)
    ours = scaled_linear(x, w, bias)
    expected = _reference_w8a8(x, w, None) + bias.double()
    torch.testing.assert_close(
        ours.double(), expected, atol=1e-4 * expected.abs().max().item(), rtol=0
    )


@pytest.mark.parametrize("shape", [(256, 384), (200, 330)], ids=["whole", "partial"])
def test_block_weight_linear_matches_the_definition(shape: tuple[int, int]) -> None:
    """Block scales, partial tiles included: the dense weight is each value times its tile's
    scale, and the CPU product (weight-only) is x times that weight."""
    g = torch.Generator().manual_seed(2)
    n, k = shape
    q, s = quantize_blocks(torch.randn(n, k, generator=g), 128, 128)
    w = FP8Weight(q, s, (n, k), (128, 128))
    assert torch.equal(w.dequantize(), dequantize_blocks(q, s, 128, 128))
    x = torch.randn(3, k, generator=g)
    torch.testing.assert_close(w.linear(x, None), x @ dequantize_blocks(q, s, 128, 128).t())


KERNEL_CASES = {
    "tensor": ((96, 160), None),
    "channel": ((37, 48), None),
    "block": ((256, 384), (128, 128)),
    "block-partial-tiles": ((200, 336), (128, 128)),
    "block-small-tiles": ((72, 96), (8, 32)),
}


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_cpu_kernel_matches_the_definition(case: str) -> None:
    """The C kernel (`native.fp8_gemv`) at 1 to 8 rows, float32 and bf16, against x times the dense
    weight of the definition (float64): fp32 order (1e-5 relative) and, for bf16, its output
    rounding (1e-2); its dequantized weight equals torch's bit for bit."""
    lib = cpu_fp8.load()
    if lib is None:
        pytest.skip("the fp8 CPU kernel does not build here")
    (n, k), block = KERNEL_CASES[case]
    g = torch.Generator().manual_seed(3)
    dense = torch.randn(n, k, generator=g)
    if block is None:
        w = quantize_fp8(dense, per_channel=case == "channel")
        exact = w.weight.float() * w.scale
    else:
        q, s = quantize_blocks(dense, *block)
        w, exact = FP8Weight(q, s, (n, k), block), dequantize_blocks(q, s, *block)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(w.dequantize(dtype), exact.to(dtype))
        for rows in range(1, 9):
            x = torch.randn(rows, k, generator=g).to(dtype)
            bias = torch.randn(n, generator=g).to(dtype)
            expected = x.double() @ exact.double().t() + bias.double()
            error = (w.linear(x, bias).double() - expected).abs().max() / expected.abs().max()
            assert error < (1e-5 if dtype == torch.float32 else 1e-2), (dtype, rows)


def test_cpu_kernel_reads_every_fp8_value_exactly() -> None:
    lib = cpu_fp8.load()
    if lib is None:
        pytest.skip("the fp8 CPU kernel does not build here")
    values = torch.arange(256, dtype=torch.uint8)
    values = values[(values & 0x7F) != 0x7F]  # every e4m3fn byte but the two NaNs
    q = torch.zeros(16, 256, dtype=torch.uint8)
    q[:, : values.numel()] = values
    w = FP8Weight(q.view(FP8_DTYPE), torch.ones(1, 1), (16, 256))
    assert torch.equal(w.dequantize(), q.view(FP8_DTYPE).float())
    eye = torch.eye(256)[:8]  # x = unit rows: the kernel's products are the weights themselves
    assert torch.equal(w.linear(eye, None), q.view(FP8_DTYPE).float()[:, :8].t())


def test_tp_slices_refuse_to_cut_a_block() -> None:
    q, s = quantize_blocks(torch.randn(256, 256), 128, 128)
    w = FP8Weight(q, s, (256, 256), (128, 128))
    half = _cut("x.weight", w, 1, 128, 128)
    assert torch.equal(half.dequantize(), w.dequantize()[:, 128:])
    with pytest.raises(ValueError, match="columns 64..128 cut the checkpoint's 128-wide"):
        _cut("x.weight", w, 1, 64, 64)


def _edit(path: str, edit: Any) -> str:
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    edit(config["quantization_config"])
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def _drop_scale(path: str) -> None:
    file = os.path.join(path, "model.safetensors")
    state = load_file(file)
    del state["model.layers.0.mlp.up_proj.weight_scale_inv"]
    save_file(state, file, metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda qc: qc.update(fmt="e5m2"), "fmt='e5m2' is not supported"),
        (lambda qc: qc.update(weight_block_size=[128]), "weight_block_size must be two"),
        (lambda qc: qc.update(weight_block_size=[128, 0]), "weight_block_size must be two"),
        (lambda qc: qc.update(activation_scheme="static"), "has no input_scale"),
        (lambda qc: qc.update(activation_scheme="tensor"), "activation_scheme must be"),
        (lambda qc: qc.update(weight_block_size=[64, 128]), "weight_block_size=\\(64, 128\\)"),
    ],
    ids=["fmt", "block-len", "block-zero", "static", "scheme", "block-mismatch"],
)
def test_bad_configs_name_the_field(tmp_path: Any, edit: Any, message: str) -> None:
    fp8 = _edit(write_fp8(tmp_path, "LlamaForCausalLM", FULL_TILES)[0], edit)
    with pytest.raises(ValueError, match=message):
        _load(fp8)


def test_missing_scale_is_named(tmp_path: Any) -> None:
    fp8, _ = write_fp8(tmp_path, "LlamaForCausalLM", FULL_TILES)
    _drop_scale(fp8)
    with pytest.raises(
        ValueError, match="up_proj.weight is float8 but .*weight_scale_inv is missing"
    ):
        _load(fp8)
    with pytest.raises(ValueError, match="quantization='int8' does not match"):
        _load(fp8, quantization="int8")
