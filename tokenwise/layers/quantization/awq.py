"""AWQ checkpoints (AutoAWQ's GEMM layout, `version="gemm"`): each linear layer's tensors as a
dense weight and an exact `QuantizedWeight` (see `prequantized` for how the loader uses both).

The published layout, for a layer `y = x @ W^T` with W `[N, K]`, 4 bits, 8 values per int32:
- `qweight` int32 `[K, N / 8]`: the integers, packed along N (the output), interleaved: field p
  of a word (bits 4p..4p+3) holds output column `8c + ORDER[p]` of its word c;
- `qzeros` int32 `[K / group_size, N / 8]`: the zero points, packed the same way;
- `scales` float16 `[K / group_size, N]`.
`w[n, k] = (q[n, k] - z[n, k // G]) * s[n, k // G]`; zero points are stored as they are (no
offset, unlike GPTQ v1). The GEMV layouts (`gemv`, `gemv_fast`) pack along K and are refused
when the config is read (`quantization_config.int_checkpoint_config`).
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

SUFFIXES = ("qweight", "qzeros", "scales")
MARKER = "qweight"
# Field p of a packed word holds column ORDER[p] of its 8 (AutoAWQ's GEMM kernel reads them so).
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def convert(config: IntCheckpointConfig, name: str, parts: dict[str, torch.Tensor]) -> Converted:
    """One layer's AWQ tensors -> its dense weight and exact record."""
    q = unpack_int32(parts["qweight"], 4, dim=1, order=ORDER).t()  # [N, K]
    zeros = unpack_int32(parts["qzeros"], 4, dim=1, order=ORDER).t()  # [N, num_groups]
    scales = parts["scales"].t()
    n, k = q.shape
    if zeros.shape != scales.shape or scales.shape[0] != n:
        raise ValueError(
            f"qweight {tuple(parts['qweight'].shape)}, qzeros {tuple(parts['qzeros'].shape)} "
            f"and scales {tuple(parts['scales'].shape)} do not describe one [{n}, {k}] weight"
        )
    size = k if config.group_size == -1 else config.group_size
    if k % size or scales.shape[1] != k // size:
        raise ValueError(
            f"group_size={config.group_size} does not divide the input size {k} into the "
            f"{scales.shape[1]} groups of its scales"
        )
    groups = torch.arange(k) // size
    dense = group_dense(q, zeros, scales, groups)
    return Converted(dense, integer_weight(name, q, zeros, scales, 4, groups, signed=False))
