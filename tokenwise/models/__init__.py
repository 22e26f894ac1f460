"""Token-wise model implementations and the registry that picks one for a checkpoint."""

from tokenwise.models.registry import (
    MODEL_REGISTRY,
    resolve_model_class,
    supported_architectures,
)

__all__ = ["MODEL_REGISTRY", "resolve_model_class", "supported_architectures"]
