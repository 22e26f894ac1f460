"""Quantization as methods: the registry the loader looks a method up in, and the
`quant_method` each linear and MoE layer computes with."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.tiny_checkpoints import build_tiny_checkpoint
from tokenwise.config import EngineConfig
from tokenwise.layers.fused_moe import FusedMoE
from tokenwise.layers.fused_moe.moe_methods import (
    UNQUANTIZED_MOE,
    WEIGHT_ONLY_MOE,
    UnquantizedFusedMoEMethod,
)
from tokenwise.layers.linear import ReplicatedLinear
from tokenwise.layers.quantization import registry
from tokenwise.layers.quantization.base_config import (
    LinearMethodBase,
    QuantizationConfig,
    is_linear,
)
from tokenwise.layers.quantization.linear_methods import WEIGHT_ONLY
from tokenwise.layers.quantization.unquantized import UNQUANTIZED, UnquantizedConfig
from tokenwise.loader import load_model
from tokenwise.model_config import ModelConfig
from tokenwise.quantization_config import METHODS

SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1}


def test_every_method_name_has_a_registered_config() -> None:
    for name in METHODS:
        config = registry.get_quantization_config(name)
        assert issubclass(config, QuantizationConfig) and config.name == name
    assert registry.get_quantization_config(None) is UnquantizedConfig


def test_an_unregistered_name_is_refused_naming_the_registered_ones() -> None:
    with pytest.raises(ValueError, match=r"quantization='nf4' has no registered method.*gptq"):
        registry.get_quantization_config("nf4")
    with pytest.raises(ValueError, match="non-empty string"):
        registry.register_quantization_config("", UnquantizedConfig)


class _Doubled(LinearMethodBase):
    """Twice the dense product; counts `process_weights_after_loading` calls."""

    processed: list[nn.Module] = []

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.processed.append(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None):
        return 2 * F.linear(x, layer.weight, bias)


class _DoubledConfig(QuantizationConfig):
    name = "doubled"

    def process_model(self, model: nn.Module) -> None:
        for module in model.modules():
            if is_linear(module) and module is not getattr(model, "lm_head", None):
                module.quant_method = _Doubled()


def test_the_loader_takes_a_registered_method_and_every_layer_computes_with_it(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A method registered in one line is what `load_model` installs: its layers' outputs are
    its `apply`'s, and each got `process_weights_after_loading` once."""
    path = build_tiny_checkpoint(tmp_path, "LlamaForCausalLM", **SHAPE)
    monkeypatch.setitem(registry.QUANTIZATION_METHODS, "doubled", _DoubledConfig)
    monkeypatch.setattr(_Doubled, "processed", [])
    config = ModelConfig.from_pretrained(path, dtype="float32")
    dense = load_model(EngineConfig(model=config))
    config.quantization = "doubled"
    model = load_model(EngineConfig(model=config))
    linears = [m for m in model.modules() if is_linear(m) and m is not model.lm_head]
    assert linears and all(isinstance(m.quant_method, _Doubled) for m in linears)
    assert sorted(map(id, _Doubled.processed)) == sorted(map(id, linears))
    assert model.lm_head.quant_method is UNQUANTIZED
    layer, dense_layer = model.model.layers[0], dense.model.layers[0]
    h = torch.randn(3, 128)
    torch.testing.assert_close(layer.mlp.down_proj(h), 2 * dense_layer.mlp.down_proj(h))
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer.self_attn.qkv_proj(x), 2 * dense_layer.self_attn.qkv_proj(x))


def test_int8_gives_linear_layers_the_weight_only_method_and_moe_experts_theirs(
    tmp_path: Any,
) -> None:
    path = build_tiny_checkpoint(tmp_path, "Qwen2MoeForCausalLM", **SHAPE)
    dense = load_model(EngineConfig(model=ModelConfig.from_pretrained(path, dtype="float32")))
    moe = dense.model.layers[0].mlp
    assert moe.experts.quant_method is UNQUANTIZED_MOE and moe.gate.quant_method is UNQUANTIZED
    config = ModelConfig.from_pretrained(path, dtype="float32", quantization="int8")
    model = load_model(EngineConfig(model=config))
    layer = model.model.layers[0]
    assert layer.self_attn.o_proj.quant_method is WEIGHT_ONLY
    assert layer.self_attn.o_proj.quant_weight.bits == 8
    assert layer.mlp.gate.quant_method is UNQUANTIZED  # the router stays dense
    assert layer.mlp.experts.quant_method is WEIGHT_ONLY_MOE


class _NoExperts(UnquantizedFusedMoEMethod):
    """Dense expert weights (so the checkpoint loads), but no expert output."""

    def apply(self, layer, hidden_states, topk_weights, topk_ids):  # type: ignore[no-untyped-def]
        self.seen = topk_ids
        return torch.zeros_like(hidden_states)


class _NoExpertsConfig(QuantizationConfig):
    name = "no-experts"

    def get_quant_method(self, layer: nn.Module, prefix: str) -> _NoExperts | None:
        return _NoExperts() if isinstance(layer, FusedMoE) else None

    def process_model(self, model: nn.Module) -> None:
        pass


def test_an_moe_layer_is_built_with_its_configs_method_and_computes_with_it(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What an MXFP4 (or any) expert method relies on: `FusedMoE` asks the config for its
    method while it is built, then routes and hands the tokens and their top-k to it."""
    path = build_tiny_checkpoint(tmp_path, "Qwen2MoeForCausalLM", **SHAPE)
    monkeypatch.setitem(registry.QUANTIZATION_METHODS, "no-experts", _NoExpertsConfig)
    config = ModelConfig.from_pretrained(path, dtype="float32")
    dense = load_model(EngineConfig(model=config)).model.layers[0].mlp.experts
    config.quantization = "no-experts"
    experts = load_model(EngineConfig(model=config)).model.layers[0].mlp.experts
    assert isinstance(experts.quant_method, _NoExperts)
    assert torch.equal(experts.w13_weight, dense.w13_weight)  # its weights loaded as before
    x, logits = torch.randn(5, 64), torch.randn(5, experts.num_experts)
    assert dense(x, logits).abs().max() > 0
    assert torch.equal(experts(x, logits), torch.zeros(5, 64))
    assert experts.quant_method.seen.shape == (5, experts.top_k)


def test_a_dense_layer_is_built_by_its_method() -> None:
    layer = ReplicatedLinear(8, 4, bias=True)
    assert layer.quant_method is UNQUANTIZED and layer.packed_weight is None
    assert [n for n, _ in layer.named_parameters()] == ["weight", "bias"]
    assert layer.weight.weight_loader == layer.weight_loader
