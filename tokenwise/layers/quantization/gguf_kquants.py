"""GGUF's K-quants (Q4_K, Q5_K, Q6_K) as group-quantized weights, exactly.

A K-quant block holds 256 values of a row in sub-blocks (8 of 32 for Q4_K / Q5_K, 16 of 16 for
Q6_K), each with a scale that is a product, `d * sc` (a float16 super-block scale times a 6-bit
or int8 sub-scale), and for Q4_K / Q5_K a minimum `dmin * m`. Those products are exact in
float32 and not in float16, so these layers keep float32 scales and offsets:

  Q4_K -> int4 with offsets, groups of 32:  w = q * (d sc) - dmin m,  q in 0..15
  Q5_K -> int8 with offsets, groups of 32:  w = q * (d sc) - dmin m,  q in 0..31
  Q6_K -> int8 symmetric,   groups of 16:  w = q * (d sc),           q in -32..31

The scales come from the blocks' bytes (the sub-scales unpacked by gguf-py's
`Q4_K.get_scale_min`); the integers from the float32 values gguf-py dequantized, as
`round((w + dmin m) / (d sc))`, which gives back each block's integer (w was computed from it
with one or two float32 roundings, far less than half a step).
"""

from __future__ import annotations

import numpy as np
import torch

from tokenwise.layers.quantization.weight_only import QuantizedWeight, pack_int4

# type -> (bytes per 256-value block, group size, bits)
KQUANTS = {"Q4_K": (144, 32, 4), "Q5_K": (176, 32, 8), "Q6_K": (210, 16, 8)}


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)[..., 0]


def _scale_min(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: per sub-block (8 per block) scale `d * sc` and minimum `dmin * m`."""
    import gguf

    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, m = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
    return d[:, None] * sc.astype(np.float32), dmin[:, None] * m.astype(np.float32)


def kquant_weight(values: torch.Tensor, raw: np.ndarray, type_name: str) -> QuantizedWeight:
    """The weight `[rows, K]` of a K-quant tensor: `values` its float32 dequantization, `raw`
    its bytes as `[rows, K / 256 * block bytes]`."""
    block_bytes, group, bits = KQUANTS[type_name]
    rows, k = values.shape
    blocks = np.ascontiguousarray(raw).reshape(-1, block_bytes)
    if type_name == "Q6_K":
        sub = blocks[:, 192:208].view(np.int8).astype(np.float32)
        scale = _f16(blocks[:, 208:210])[:, None] * sub
        minimum = np.zeros_like(scale)
    else:
        scale, minimum = _scale_min(blocks)
    scale_t = torch.from_numpy(scale.reshape(rows, k // group))
    min_t = torch.from_numpy(minimum.reshape(rows, k // group))
    grouped = values.reshape(rows, k // group, group)
    safe = torch.where(scale_t == 0, torch.ones_like(scale_t), scale_t)
    q = torch.round((grouped + min_t[..., None]) / safe[..., None]).reshape(rows, k)
    if type_name == "Q4_K":
        qweight = pack_int4(q.clamp(0, 15).to(torch.uint8))
    else:
        low, high = (-32, 31) if type_name == "Q6_K" else (0, 31)
        qweight = q.clamp(low, high).to(torch.int8).contiguous()
    return QuantizedWeight(
        qweight=qweight,
        scales=scale_t.contiguous(),
        offsets=None if type_name == "Q6_K" else (-min_t).contiguous(),
        bits=bits,
        group_size=group,
        shape=(rows, k),
    )
