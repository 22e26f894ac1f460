"""An fp8 KV cache (vLLM's `kv_cache_dtype="fp8"`): what the cache stores, and how.

Why: decode reads the whole cache every step, and the cache's size bounds how many tokens the
engine can hold at once. One fp8 byte per element instead of bf16's two holds twice the tokens
in the same `kv_cache_memory` and halves the bytes a decode step streams.

The scheme is vLLM's: each attention layer has a `k_scale` and a `v_scale` (1.0 unless a
checkpoint gives them); a key is stored as `fp8(clamp(k / k_scale))` and read back as
`float(stored) * k_scale`, values likewise. The clamp to the format's largest finite value
(448 for e4m3, 57344 for e5m2) makes the write saturate: an outlier is stored as the largest
fp8 number of its sign instead of NaN (e4m3 has no infinity) or inf (e5m2), which one bad key
would otherwise spread to the whole row's softmax. Rounding is to nearest even, torch's.

Formats: "fp8" / "fp8_e4m3" is `float8_e4m3fn` (3 mantissa bits: a relative error of at most
2^-4 per element; range 2^-9 .. 448), "fp8_e5m2" is `float8_e5m2` (2 mantissa bits, 2^-3;
range 2^-16 .. 57344). torch's CPU has no `index_copy_` / `index_select` for fp8 dtypes, so the
writes and gathers here go through a `uint8` view of the same bytes.
"""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_NAMED = {
    "bfloat16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def kv_cache_torch_dtype(cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of a `kv_cache_dtype` setting ("auto": the model's dtype)."""
    if cache_dtype == "auto":
        return model_dtype
    return _NAMED[cache_dtype]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """`x / scale` in the cache's `dtype`, saturating at the format's finite range."""
    if not is_fp8(dtype):
        return x.to(dtype)
    limit = torch.finfo(dtype).max
    scaled = x.float() if scale == 1.0 else x.float() / scale
    return scaled.clamp_(-limit, limit).to(dtype)


def dequantize(cached: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Cache entries as `dtype` values (`* scale` for fp8); other caches come back as they are."""
    if not is_fp8(cached.dtype):
        return cached
    out = cached.to(dtype)
    return out if scale == 1.0 else out.mul_(scale)


def gather_rows(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`cache.index_select(0, index)` for every cache dtype (fp8 through its bytes)."""
    if not is_fp8(cache.dtype):
        return cache.index_select(0, index)
    return cache.view(torch.uint8).index_select(0, index).view(cache.dtype)


def write_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, scale: float) -> None:
    """`cache[slots] = quantize(rows)` along dim 0, for every cache dtype."""
    stored = quantize(rows, cache.dtype, scale)
    if is_fp8(cache.dtype):
        cache.view(torch.uint8).index_copy_(0, slots, stored.view(torch.uint8))
    else:
        cache.index_copy_(0, slots, stored)
