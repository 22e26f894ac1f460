"""GPTQ checkpoints (AutoGPTQ, GPTQModel, optimum): each linear layer's tensors as a dense weight
and an exact `QuantizedWeight` (see `prequantized` for how the loader uses both).

The published layout, for a layer `y = x @ W^T` with W `[N, K]` and `bits` 4 or 8
(`32 / bits` values per int32 word, lowest bits first):
- `qweight` int32 `[K / per_word, N]`: the integers `q`, packed along K (the input);
- `qzeros` int32 `[num_groups, N / per_word]`: the zero points, packed along N (the output);
- `scales` float16 `[num_groups, N]`;
- `g_idx` int32 `[K]` (optional): each input column's group; `arange(K) // group_size` unless
  the checkpoint was made with act-order (`desc_act`), which groups columns by importance.
`w[n, k] = (q[n, k] - z[n, g]) * s[n, g]` with `g = g_idx[k]`. In GPTQ's original format
(`checkpoint_format="gptq"`, v1, what AutoGPTQ wrote) each zero point is stored minus one and
the readers add the one back, unmasked (a zero point of 0 comes back as 2^bits: the historical
quirk every v1 reader keeps, so this one does too); `gptq_v2` (GPTQModel) stores them as they
are. `sym` changes nothing here: symmetric checkpoints store the midpoint (8) as their zero.

Act-order layers keep their quantized form: `integer_weight` stores the columns sorted by group
and the layer permutes its input to match (`QuantizedWeight.input_perm`).
"""

from __future__ import annotations

import torch

from tokenwise.layers.quantization.prequantized import (
    Converted,
    group_dense,
    integer_weight,
    unpack_int32,
)
from tokenwise.quantization_config import IntCheckpointConfig

SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")
MARKER = "qweight"


def layer_groups(
    config: IntCheckpointConfig, k: int, num_groups: int, g_idx: torch.Tensor | None
) -> torch.Tensor:
    """Each input column's group (int64 `[K]`), checked against the scales' group count."""
    size = k if config.group_size == -1 else config.group_size
    if k % size:
        raise ValueError(f"group_size={config.group_size} does not divide the input size {k}")
    if num_groups != k // size:
        raise ValueError(
            f"{num_groups} groups of scales, but group_size={config.group_size} gives "
            f"{k // size} over the input size {k}"
        )
    if g_idx is None:
        return torch.arange(k) // size
    groups = g_idx.to(torch.int64)
    if groups.shape != (k,) or int(groups.min()) < 0 or int(groups.max()) >= num_groups:
        raise ValueError(f"g_idx must hold {k} group numbers below {num_groups}")
    return groups


def convert(config: IntCheckpointConfig, name: str, parts: dict[str, torch.Tensor]) -> Converted:
    """One layer's GPTQ tensors -> its dense weight and exact record."""
    bits = config.bits
    q = unpack_int32(parts["qweight"], bits, dim=0).t()  # [N, K]
    zeros = unpack_int32(parts["qzeros"], bits, dim=1).t()  # [N, num_groups]
    scales = parts["scales"].t()
    n, k = q.shape
    if zeros.shape != scales.shape or scales.shape[0] != n:
        raise ValueError(
            f"qweight {tuple(parts['qweight'].shape)}, qzeros {tuple(parts['qzeros'].shape)} "
            f"and scales {tuple(parts['scales'].shape)} do not describe one [{n}, {k}] weight"
        )
    if config.zeros_minus_one:
        zeros = zeros + 1
    groups = layer_groups(config, k, scales.shape[1], parts.get("g_idx"))
    dense = group_dense(q, zeros, scales, groups)
    return Converted(dense, integer_weight(name, q, zeros, scales, bits, groups, signed=False))
