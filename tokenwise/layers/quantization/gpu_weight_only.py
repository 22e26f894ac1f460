"""Group-quantized (int8 / int4) linear layers off the CPU: the weights stay integers on the device.

`QuantizedWeight.linear` hands a non-CPU input here, in the layer's storage column order (any
act-order permutation already applied). Two routes, chosen per layer at load (`gpu_selfcheck`):
- int4 layers whose format tinygemm takes and whose packing passed the load-time self-check
  (`weight.device_kernel`), with bfloat16 activations, or float16 ones rounded to bfloat16
  for the product (relative 2^-9: the kernel takes bfloat16 only; GPTQ / AWQ checkpoints
  are often float16): `gpu_int4`'s kernel, for every row count. tinygemm is a decode
  kernel: pytorch/ao's measurements show it falling behind a dense matmul as rows grow
  (prefill), but a layer that passed keeps its integers only in tinygemm's layout, so
  dequantizing for large calls would cost more than it saves (not measured here).
- every other layer (a float32 model's included): the weight dequantized per call with torch
  ops on the device, in float32 (the definition's arithmetic, so the values equal
  `reference_dequantize`'s) then x's dtype, and torch's matmul. Correct and slower (one dense copy of the layer per call, transient);
  the integer memory is kept. int8 always takes this route: torch's `_weight_int8pack_mm`
  takes one scale per output row, and tokenwise's int8 layers have a scale per 32 values.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

# Activations the kernel route takes (float16 rounded to bfloat16 for the product).
KERNEL_DTYPES = (torch.bfloat16, torch.float16)


def linear(weight: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ W^T + bias` in x's dtype for a `QuantizedWeight` on x's (non-CPU) device."""
    kernel = weight.device_kernel
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    if kernel is not None and x.dtype in KERNEL_DTYPES and x.numel():
        out = kernel.mm(x.to(torch.bfloat16)).to(x.dtype)
        return out if bias is None else out + bias
    return F.linear(x, dequantize_stored(weight, x.dtype), bias)


def int4_values(qweight: torch.Tensor) -> torch.Tensor:
    """uint8 `[N, K / 2]` in GGUF's nibble order (within 32 values, byte j: value j low,
    value j + 16 high) -> uint8 values `[N, K]` in 0..15."""
    n = qweight.shape[0]
    blocks = qweight.reshape(n, -1, 16)
    return torch.stack((blocks & 15, blocks >> 4), dim=2).reshape(n, -1)


def dequantize_stored(weight: Any, dtype: torch.dtype) -> torch.Tensor:
    """The dense `[N, K]` in `dtype`, columns in storage order, with torch ops on the weight's
    device: `q * s + o` per group in float32 (int4 without offsets: `o = -8 s`)."""
    kernel = weight.device_kernel
    if kernel is not None and kernel.owns_integers:
        return kernel.dense(dtype)
    return _dense(weight, weight.qweight, weight.scales, weight.offsets, dtype)


def rows(weight: Any, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of the dense weight in `dtype`, `[*ids.shape, K]`: a quantized embedding's
    lookup on the device (torch ops only, so a compiled model traces it in one graph)."""
    flat = ids.reshape(-1)
    offsets = None if weight.offsets is None else weight.offsets[flat]
    dense = _dense(weight, weight.qweight[flat], weight.scales[flat], offsets, dtype)
    return dense.reshape(*ids.shape, weight.shape[1])


def _dense(
    weight: Any,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """`q * s + o` of some rows of `weight`'s format, in float32, then `dtype`."""
    n, k, g = qweight.shape[0], weight.shape[1], weight.group_size
    q = int4_values(qweight) if weight.bits == 4 else qweight
    q = q.reshape(n, k // g, g).float()
    s = scales.float().unsqueeze(-1)
    if offsets is not None:
        dense = torch.addcmul(offsets.float().unsqueeze(-1), q, s)
    elif weight.bits == 4:
        dense = (q - 8.0) * s
    else:
        dense = q * s
    return dense.reshape(n, k).to(dtype)
