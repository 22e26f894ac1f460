"""The static registry through which opaque ops find their layers by name
(docs/forward-context.md §5).

Layers that read the forward context (attention, MoE) register under their full module path
(`model.layers.3.self_attn.attn`) when constructed. The registry is the config's
`compilation.static_forward_context` dict, which every forward context shares by identity, so a
custom op that receives only a layer name can reach the layer and its KV cache.
"""

from __future__ import annotations

from typing import Any, TypeVar

from tokenwise.config import CompilationConfig, EngineConfig

T = TypeVar("T")


def _registry(config: EngineConfig | CompilationConfig | dict[str, Any]) -> dict[str, Any]:
    if isinstance(config, EngineConfig):
        return config.compilation.static_forward_context
    if isinstance(config, CompilationConfig):
        return config.static_forward_context
    if isinstance(config, dict):
        return config
    raise TypeError(f"expected an EngineConfig, CompilationConfig or dict, got {type(config)}")


def register_static_layer(
    config: EngineConfig | CompilationConfig | dict[str, Any], prefix: str, layer: Any
) -> None:
    """Register `layer` under `prefix`; a second layer with the same name is an error."""
    if not prefix:
        raise ValueError(
            "a layer that reads the forward context needs its full module path as prefix "
            "(e.g. 'model.layers.0.self_attn.attn'), got an empty prefix"
        )
    registry = _registry(config)
    if prefix in registry:
        raise ValueError(f"duplicate layer name in the static forward context: {prefix!r}")
    registry[prefix] = layer


def get_layers_from_config(
    config: EngineConfig | CompilationConfig | dict[str, Any], layer_type: type[T]
) -> dict[str, T]:
    """Registered layers of one type, in registration (model) order."""
    return {
        name: layer for name, layer in _registry(config).items() if isinstance(layer, layer_type)
    }
