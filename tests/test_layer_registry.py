"""The static layer registry (forward-context.md §5): layers found by name through the context."""

from __future__ import annotations

import pytest

from tokenwise.config import CompilationConfig, EngineConfig
from tokenwise.forward_context import create_forward_context, set_forward_context
from tokenwise.layer_registry import get_layers_from_config, register_static_layer


class FakeAttention:
    pass


class FakeMoE:
    pass


def test_register_stores_the_layer_under_its_prefix() -> None:
    config = EngineConfig()
    layer = FakeAttention()
    register_static_layer(config, "model.layers.3.self_attn.attn", layer)
    assert config.compilation.static_forward_context == {"model.layers.3.self_attn.attn": layer}
    assert config.compilation.static_forward_context["model.layers.3.self_attn.attn"] is layer


def test_register_accepts_a_compilation_config_or_the_dict_itself() -> None:
    config = EngineConfig()
    a, b = FakeAttention(), FakeAttention()
    register_static_layer(config.compilation, "a", a)
    register_static_layer(config.compilation.static_forward_context, "b", b)
    assert config.compilation.static_forward_context == {"a": a, "b": b}
    standalone = CompilationConfig()
    register_static_layer(standalone, "c", a)
    assert standalone.static_forward_context == {"c": a}


def test_register_rejects_other_targets() -> None:
    with pytest.raises(
        TypeError, match="expected an EngineConfig, CompilationConfig or dict, got <class 'list'>"
    ):
        register_static_layer([], "x", FakeAttention())  # type: ignore[arg-type]


def test_duplicate_name_is_an_error_naming_it() -> None:
    config = EngineConfig()
    first = FakeAttention()
    register_static_layer(config, "model.layers.0.self_attn.attn", first)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.attn"):
        register_static_layer(config, "model.layers.0.self_attn.attn", FakeAttention())
    # The first registration is untouched.
    assert config.compilation.static_forward_context["model.layers.0.self_attn.attn"] is first


@pytest.mark.parametrize("prefix", ["", None])
def test_empty_prefix_is_rejected(prefix: str | None) -> None:
    config = EngineConfig()
    with pytest.raises(ValueError, match="prefix"):
        register_static_layer(config, prefix, FakeAttention())  # type: ignore[arg-type]
    assert config.compilation.static_forward_context == {}


def test_get_layers_filters_by_type_and_keeps_order() -> None:
    config = EngineConfig()
    a2, m0, a0, a1 = FakeAttention(), FakeMoE(), FakeAttention(), FakeAttention()
    # Registration order (model order) differs from name order on purpose.
    register_static_layer(config, "model.layers.2.attn", a2)
    register_static_layer(config, "model.layers.0.moe", m0)
    register_static_layer(config, "model.layers.0.attn", a0)
    register_static_layer(config, "model.layers.1.attn", a1)
    attn = get_layers_from_config(config, FakeAttention)
    assert list(attn) == ["model.layers.2.attn", "model.layers.0.attn", "model.layers.1.attn"]
    assert list(attn.values()) == [a2, a0, a1]
    assert get_layers_from_config(config, FakeMoE) == {"model.layers.0.moe": m0}
    assert get_layers_from_config(EngineConfig(), FakeAttention) == {}


def test_layer_registered_after_context_creation_is_visible() -> None:
    config = EngineConfig()
    ctx = create_forward_context(None, config)
    assert ctx.no_compile_layers is config.compilation.static_forward_context
    layer = FakeAttention()
    register_static_layer(config, "model.layers.0.self_attn.attn", layer)
    assert ctx.no_compile_layers["model.layers.0.self_attn.attn"] is layer


def test_set_forward_context_exposes_the_registry_by_name() -> None:
    config = EngineConfig()
    layer = FakeAttention()
    register_static_layer(config, "model.layers.0.self_attn.attn", layer)
    with set_forward_context(None, config) as ctx:
        assert ctx.no_compile_layers is config.compilation.static_forward_context
        assert ctx.no_compile_layers["model.layers.0.self_attn.attn"] is layer
