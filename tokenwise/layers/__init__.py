"""Building blocks of the token-wise models: plain PyTorch modules, no engine state."""

from tokenwise.layers.activation import SiluAndMul, get_act_and_mul, get_act_fn
from tokenwise.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tokenwise.layers.layernorm import RMSNorm
from tokenwise.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from tokenwise.layers.rotary_embedding import RotaryEmbedding, get_rope_config
from tokenwise.layers.weight_utils import default_weight_loader, load_stacked_weights

__all__ = [
    "ColumnParallelLinear",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "QKVParallelLinear",
    "RMSNorm",
    "ReplicatedLinear",
    "RowParallelLinear",
    "RotaryEmbedding",
    "SiluAndMul",
    "VocabParallelEmbedding",
    "default_weight_loader",
    "get_act_and_mul",
    "get_act_fn",
    "get_rope_config",
    "load_stacked_weights",
]
