"""Building blocks of the token-wise models: plain PyTorch modules, no engine state."""

from tokenwise.layers.activation import SiluAndMul, get_act_and_mul
from tokenwise.layers.embedding import LMHead, VocabEmbedding
from tokenwise.layers.layernorm import RMSNorm
from tokenwise.layers.linear import (
    MergedLinear,
    QKVLinear,
    ReplicatedLinear,
    default_weight_loader,
)
from tokenwise.layers.rotary_embedding import RotaryEmbedding, get_rope_config

__all__ = [
    "LMHead",
    "MergedLinear",
    "QKVLinear",
    "RMSNorm",
    "ReplicatedLinear",
    "RotaryEmbedding",
    "SiluAndMul",
    "VocabEmbedding",
    "default_weight_loader",
    "get_act_and_mul",
    "get_rope_config",
]
