"""Embedding models: pooling parameters, the checkpoint's pooling config, and the pooler."""

from tokenwise.pooling.params import PoolingParams

__all__ = ["PoolingParams"]
