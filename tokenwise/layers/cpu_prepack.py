"""Linear weights reordered once for oneDNN, so CPU matmuls skip the per-call reorder.

`F.linear` on CPU hands a plain row-major weight to the BLAS on every call; for the small row
counts of decode steps (one row per running sequence) that is far from the machine's matmul
rate. oneDNN's linear over a weight reordered once, at load, into its own blocked layout is
much closer. Measured on an AVX2 EPYC, 2 threads, fp32 (`python benchmarks/linear_prepack.py`):
48 rows x 768 -> 32000 (an LM head in a decode step) went from 76 to 131 GFLOP/s, the body's
layers from ~115 to ~145, and large prefill chunks stay within a few per cent either way.

The reordered tensor is an opaque oneDNN tensor held beside the layer's `weight`, which stays
what it was (loaders, LoRA, TP and tests read it), so a prepacked layer holds its weight twice.
`prepack_linear_weights` therefore only packs when the copies fit comfortably in free memory,
and `TOKENWISE_CPU_PREPACK=0` / `=1` turns it off / on regardless.

bfloat16 weights are packed as bfloat16 where oneDNN has bf16 kernels (native on AVX512_BF16
or AMX, emulated with AVX-512 conversions elsewhere). Where it has none (AVX2-only CPUs), a
bf16 matmul runs a scalar loop: 1 GFLOP/s against 160 for fp32 on an AVX2 EPYC. There the
packed copy is the weight widened to float32, and the layer computes `x` widened to float32
times it, rounded back to bf16: the products of bf16 values are exact in fp32 and the sums
accumulate in fp32, as native bf16 kernels do, so results stay bf16 results.

Decode-sized calls (`native.gemv.max_rows(dtype)` rows at most, by vector path and dtype)
skip all this for `native.gemv`'s C kernel over the plain weight, which streams weights closer
to the memory bandwidth; it says when it is used and how to turn it off
(`TOKENWISE_CPU_GEMV=0`). `linear` is the dense linear method's product
(`layers.quantization.unquantized`); quantized layers hold no packed copy.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from tokenwise import envs
from tokenwise.native import gemv as cpu_gemv

logger = logging.getLogger(__name__)

# Packed copies may take at most this share of the memory available when packing starts.
MAX_SHARE_OF_AVAILABLE = 0.25


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    packed: torch.Tensor | None,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for a dense layer: decode-sized calls (`cpu_gemv.max_rows`
    rows at most) through the small-M C kernel where it is available, others through the
    prepacked weight when the layer has one (`packed`)."""
    # Under torch.compile the row count is symbolic (no guard may depend on it) and the
    # compiler lays out its own matmuls: the traced graph always takes F.linear.
    if x.device.type != "cpu" or x.dtype != weight.dtype or torch.compiler.is_compiling():
        return F.linear(x, weight, bias)
    max_rows = cpu_gemv.max_rows(x.dtype)
    if 0 < x.numel() <= max_rows * x.shape[-1] and cpu_gemv.usable(x, weight):
        return cpu_gemv.linear(cpu_gemv.load(), x, weight, bias)
    if packed is None:
        return F.linear(x, weight, bias)
    return _packed_linear(x, packed, bias)


def _packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    if packed.dtype == x.dtype:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    # A bf16 layer over its float32-widened copy (no bf16 kernels on this CPU).
    out = torch.ops.mkldnn._linear_pointwise(x.float(), packed, None, "none", [], "")
    out = out.to(x.dtype)
    return out if bias is None else out + bias


def onednn_has_bf16() -> bool:
    """Whether oneDNN has bf16 kernels on this CPU (native or emulated with AVX-512)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _packed_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """The dtype a weight of `dtype` is packed in, or None when it is not packed."""
    if dtype == torch.float32:
        return torch.float32
    if dtype == torch.bfloat16:
        return torch.bfloat16 if onednn_has_bf16() else torch.float32
    return None


def _available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _wanted(total_bytes: int) -> bool:
    setting = envs.get("TOKENWISE_CPU_PREPACK").strip().lower()
    if setting in ("0", "false", "off", "no"):
        return False
    if setting in ("1", "true", "on", "yes"):
        return True
    available = _available_bytes()
    if available is not None and total_bytes > MAX_SHARE_OF_AVAILABLE * available:
        logger.info(
            "linear weights not prepacked for oneDNN: the copies (%.0f MiB) would take more "
            "than %d%% of the available memory (%.0f MiB); TOKENWISE_CPU_PREPACK=1 forces it",
            total_bytes / 2**20,
            int(MAX_SHARE_OF_AVAILABLE * 100),
            available / 2**20,
        )
        return False
    return True


def prepack_linear_weights(model: nn.Module) -> int:
    """Give every dense CPU linear layer of `model` (modules with `packed_weight` whose weight
    is a CPU tensor: quantized layers' weights are on the meta device) a weight reordered for
    oneDNN; returns how many were packed."""
    if not torch.backends.mkldnn.is_available():
        return 0
    layers = [
        module
        for module in model.modules()
        if hasattr(module, "packed_weight")
        and module.packed_weight is None
        and module.weight.device.type == "cpu"
        and module.weight.dim() == 2
        and _packed_dtype(module.weight.dtype) is not None
    ]
    # A tied LM head shares its embedding's weight object but gets its own packed copy.
    total = sum(
        layer.weight.numel() * _packed_dtype(layer.weight.dtype).itemsize for layer in layers
    )
    if not layers or not _wanted(total):
        return 0
    repack_linear_weights(layers)
    logger.info(
        "prepacked %d linear weights for oneDNN (%.0f MiB beside the plain weights)",
        len(layers),
        total / 2**20,
    )
    return len(layers)


def repack_linear_weights(layers: list[nn.Module]) -> None:
    """Pack these layers' weights again (they were packed before and their weights changed or
    came back from sleep): the same reorder as at load, so results stay bit for bit."""
    for layer in layers:
        weight = layer.weight.detach()
        packed_dtype = _packed_dtype(weight.dtype)
        layer.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.to(packed_dtype))
