"""Group-quantized linear weights (int8 / int4, weight-only) and their round-to-nearest quantizer.

A weight `[N, K]` is cut into groups of `group_size` consecutive values of a row; each group
keeps a float16 scale `s` and, when asymmetric, a float16 offset `o`, and each value an integer
`q`: `w = q * s + o`. (Scales and offsets may be float32 instead, for formats whose scales are
products float16 does not hold, e.g. GPTQ's offsets `-z * s`.) Without offsets int8 is symmetric (`o = 0`, q in [-127, 127]) and int4 is
centred on 8 (`o = -8 s`, q in [0, 15]): those are GGUF's Q8_0 and Q4_0 exactly (float16 scale
per 32 values), and with offsets int4 is Q4_1's form (GPTQ's and AWQ's too, with `o = -z s`).
int4 values are packed two per byte in GGUF's order: within each 32 values, byte j holds value j
(low nibble) and value j + 16 (high nibble). See `native/qgemv.c` for the kernel that reads them.

`input_perm` (GPTQ's act-order, `g_idx`): a checkpoint may group input columns that are not
consecutive. The columns are then stored sorted by group, so each group is consecutive again,
and the layer reads its input in that order: `x[..., input_perm] @ W[:, input_perm]^T` is
`x @ W^T`. One gather of the activations per call, instead of giving up the kernel. A
tensor-parallel rank's slice of such a layer may also hold padding columns (`act_order_slice`):
then `input_size` is the layer's input width, and `input_perm` entries equal to it read a zero
appended to the input.

Off the CPU (CUDA), `linear` hands the input to `gpu_weight_only`: torch's int4 kernel
(`gpu_int4`) where the load-time self-check (`gpu_selfcheck`) gave the layer its
`device_kernel`, else the weight dequantized per call with torch ops on the device.

Why weight-only, with activations kept in floating point: results stay close to the dense model
(the only error is the weights' rounding), and decode, bound by reading weights, gets faster in
proportion to the bytes saved: int8 reads ~53% of bf16's bytes, int4 ~28% (~31% with offsets).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from tokenwise.layers.quantization import gpu_weight_only
from tokenwise.native import qgemv as cpu_qgemv

BITS = (8, 4)
# Row counts, by weight bits, above which the dense weight is rebuilt for torch's matmul rather
# than the kernel run over chunks of `cpu_qgemv.KERNEL_MAX_ROWS` rows (each chunk one call that
# tiles its rows, every weight block read once: `qgemv.c`'s `run_tiles`). Rebuilding costs the
# same at any row count (int4 about 2.5 ns per weight on one AVX2 core, int8 about 1), the
# kernel grows with the rows: on the Qwen3-0.6B shape's layers, one AVX2 thread, 64 rows took
# int4 6.1-6.4 ms through the kernel against 15.9 dequantized, int8 7.9 against 9.8
# (benchmarks/RESULTS.md, 2026-11-28), so int4 pays up to about 512 rows, int8 to about 128.
# Those are figures of the int8-activation path; the others stop at one call's rows.
KERNEL_MAX_ROWS = {8: 128, 4: 512}


def group_multiple(bits: int) -> int:
    """What a group size must be a multiple of (the kernel's vector width per group)."""
    return 16 if bits == 8 else 32


@dataclass(eq=False)
class QuantizedWeight:
    """One layer's quantized weight; a linear layer holds it in `quant_weight`."""

    qweight: torch.Tensor  # int8 [N, K], or uint8 [N, K / 2] for int4
    scales: torch.Tensor  # float16 (or float32) [N, K / group_size]
    offsets: torch.Tensor | None  # like scales, or None (symmetric)
    bits: int
    group_size: int
    shape: tuple[int, int]  # (N, K) of the dense weight
    # Column j of qweight / scales is input column input_perm[j] (int64 [K]); None: in order.
    input_perm: torch.Tensor | None = None
    # The layer's input width where the stored columns include padding (then input_perm holds
    # input_size for each padding column: it reads a zero); None: shape[1].
    input_size: int | None = None
    # Off the CPU: the layer's kernel (`gpu_int4.Int4Kernel`), set at load by `gpu_selfcheck`
    # once its packing passed the self-check; None: dequantized per call (`gpu_weight_only`).
    device_kernel: Any = field(default=None, repr=False)
    # Integers and scales read from a GGUF file: float32 activations then default to int8, the
    # arithmetic llama.cpp runs these blocks with (`cpu_qgemv.default_x_bits`).
    gguf_file: bool = False

    def __post_init__(self) -> None:
        if self.scales.dtype not in (torch.float16, torch.float32):
            raise ValueError(f"scales must be float16 or float32, got {self.scales.dtype}")
        if self.offsets is not None and self.offsets.dtype != self.scales.dtype:
            raise ValueError("offsets must have the scales' dtype")
        if self.input_size is not None and self.input_perm is None:
            raise ValueError("input_size (padding columns) needs an input_perm")

    @property
    def in_features(self) -> int:
        """The width of the input the layer reads (the stored columns less any padding)."""
        return self.shape[1] if self.input_size is None else self.input_size

    @property
    def nbytes(self) -> int:
        parts = (self.qweight, self.scales, self.offsets, self.input_perm)
        total = sum(t.numel() * t.element_size() for t in parts if t is not None)
        return total + (0 if self.device_kernel is None else self.device_kernel.nbytes)

    def describe(self) -> str:
        kind = "asymmetric" if self.offsets is not None else "symmetric"
        order = ", permuted input" if self.input_perm is not None else ""
        if self.input_size is not None:
            order += f" (+{self.shape[1] - self.input_size} padding columns)"
        return f"int{self.bits} {kind}, groups of {self.group_size}{order}"

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense weight `[N, K]` in `dtype`, columns in the input's order."""
        return _unpermute(self._stored_dense(dtype), self.input_perm, self.in_features)

    def _stored_dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The dense weight with its columns in storage order (`input_perm` not undone)."""
        if self.qweight.device.type != "cpu":
            return gpu_weight_only.dequantize_stored(self, dtype)
        lib = cpu_qgemv.load()
        if lib is not None and dtype in (torch.float32, torch.bfloat16):
            args = (self.qweight, self.scales, self.offsets, self.bits, self.group_size)
            return cpu_qgemv.dequantize(lib, *args, self.shape, dtype)
        return _stored_reference(self).to(dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of the dense weight in `dtype` (an embedding lookup: `[*ids.shape, K]`)."""
        if self.input_perm is not None:
            raise ValueError("a quantized embedding cannot have a permuted input")
        if self.qweight.device.type != "cpu":
            return gpu_weight_only.rows(self, ids, dtype)
        lib = cpu_qgemv.load() if ids.device.type == "cpu" else None
        if lib is not None and dtype in (torch.float32, torch.bfloat16):
            args = (self.qweight, self.scales, self.offsets, self.bits, self.group_size)
            return cpu_qgemv.rows(lib, ids, *args, self.shape[1], dtype)
        flat = ids.reshape(-1)
        offsets = None if self.offsets is None else self.offsets[flat]
        picked = QuantizedWeight(
            self.qweight[flat], self.scales[flat], offsets, self.bits, self.group_size,
            (flat.numel(), self.shape[1]),
        )  # fmt: skip
        return reference_dequantize(picked).to(dtype).reshape(*ids.shape, self.shape[1])

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """`x @ W^T + bias` for x of any row count, in x's dtype."""
        rows = x.numel() // self.in_features if x.numel() else 0
        if self.input_perm is not None:
            if self.input_size is not None:
                x = F.pad(x, (0, 1))  # the zero column that padding columns read
            x = x.index_select(-1, self.input_perm)
        if x.device.type != "cpu":
            return gpu_weight_only.linear(self, x, bias)
        lib = cpu_qgemv.load() if x.dtype in (torch.float32, torch.bfloat16) else None
        if lib is None or rows == 0:
            return F.linear(x, self._stored_dense(x.dtype), bias)
        x_bits = cpu_qgemv.default_x_bits(x.dtype, self.gguf_file)
        chunk = cpu_qgemv.KERNEL_MAX_ROWS
        if rows > (KERNEL_MAX_ROWS[self.bits] if x_bits == 8 else chunk):
            return F.linear(x, self._stored_dense(x.dtype), bias)
        if rows <= chunk:
            return self._kernel(lib, x, bias, x_bits)
        flat = x.reshape(rows, self.shape[1])
        parts = [
            self._kernel(lib, flat[i : i + chunk], bias, x_bits) for i in range(0, rows, chunk)
        ]
        return torch.cat(parts).reshape(*x.shape[:-1], self.shape[0])

    def _kernel(self, lib, x: torch.Tensor, bias: torch.Tensor | None, x_bits: int) -> torch.Tensor:
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        args = (self.qweight, self.scales, self.offsets, bias, self.bits, self.group_size)
        return cpu_qgemv.qgemv(lib, x, *args, self.shape[0], x_bits=x_bits)


@dataclass(eq=False)
class QuantizedParts:
    """A fused layer whose parts (q / k / v rows, gate / up) are quantized in different formats
    (a GGUF file may store v as Q6_K beside q and k in Q4_K): one product per part, outputs
    side by side. The same interface as `QuantizedWeight`."""

    parts: list[QuantizedWeight]

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def describe(self) -> str:
        return " | ".join(p.describe() for p in self.parts)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([p.dequantize(dtype) for p in self.parts])

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        sizes = [p.shape[0] for p in self.parts]
        biases = [None] * len(sizes) if bias is None else list(bias.split(sizes))
        return torch.cat([p.linear(x, b) for p, b in zip(self.parts, biases, strict=True)], -1)


@dataclass(eq=False)
class QuantizedExperts:
    """An MoE layer's routed experts, each expert's gate/up and down weights quantized alone
    (`w13[e]`: `[2 I, H]`, `w2[e]`: `[H, I]`); `FusedMoE` runs them one expert at a time."""

    w13: list[QuantizedWeight]
    w2: list[QuantizedWeight]

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in (*self.w13, *self.w2))


def stack_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Row blocks of one format (a fused layer's q / k / v, or a record's slices) as one
    weight: integers, scales and offsets concatenated in order (the first part's input order)."""
    first = parts[0]
    offsets = None if first.offsets is None else torch.cat([p.offsets for p in parts])
    return QuantizedWeight(
        qweight=torch.cat([p.qweight for p in parts]),
        scales=torch.cat([p.scales for p in parts]),
        offsets=offsets,
        bits=first.bits,
        group_size=first.group_size,
        shape=(sum(p.shape[0] for p in parts), first.shape[1]),
        input_perm=first.input_perm,
        input_size=first.input_size,
        gguf_file=all(p.gguf_file for p in parts),
    )


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 `[N, K / 2]` in GGUF's nibble order -> uint8 values `[N, K]` in 0..15."""
    n = packed.shape[0]
    blocks = packed.reshape(n, -1, 16)
    return torch.stack((blocks & 15, blocks >> 4), dim=2).reshape(n, -1)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """uint8 values `[N, K]` in 0..15 (K a multiple of 32) -> uint8 `[N, K / 2]`."""
    n = values.shape[0]
    halves = values.to(torch.uint8).reshape(n, -1, 2, 16)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, -1).contiguous()


def reference_dequantize(weight: QuantizedWeight) -> torch.Tensor:
    """float32 `[N, K]` with torch ops: the definition the kernels are tested against."""
    return _unpermute(_stored_reference(weight), weight.input_perm, weight.in_features)


def _unpermute(stored: torch.Tensor, perm: torch.Tensor | None, columns: int) -> torch.Tensor:
    """Columns in storage order -> the `columns` in the input's order (column perm[j] is
    stored column j; padding columns, perm[j] == columns, are left out)."""
    if perm is None:
        return stored
    if stored.shape[1] != columns:
        real = perm < columns
        perm, stored = perm[real], stored[:, real]
    dense = stored.new_empty(stored.shape[0], columns)
    dense[:, perm] = stored
    return dense


def _stored_reference(weight: QuantizedWeight) -> torch.Tensor:
    n, k = weight.shape
    g = weight.group_size
    if weight.bits == 8:
        q = weight.qweight.float()
    else:
        q = unpack_int4(weight.qweight).float()
    s = weight.scales.float().repeat_interleave(g, dim=1)
    if weight.offsets is not None:
        o = weight.offsets.float().repeat_interleave(g, dim=1)
    else:
        o = -8.0 * s if weight.bits == 4 else torch.zeros_like(s)
    return (q * s + o).reshape(n, k)


def quantize(
    weight: torch.Tensor, bits: int, group_size: int = 32, symmetric: bool = True
) -> QuantizedWeight:
    """Round-to-nearest quantization of a dense `[N, K]` weight, per group of `group_size`.

    Symmetric int8 / int4 follow llama.cpp's Q8_0 / Q4_0 quantizers to the bit (integers from
    the float32 scale, then the scale stored as float16), so a matrix quantizes to the same
    blocks as `llama-quantize` gives it. With offsets (asymmetric) the scale and offset are
    rounded to float16 first and the integers chosen against the rounded values.
    """
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits!r}")
    n, k = weight.shape
    multiple = group_multiple(bits)
    if group_size < 1 or group_size % multiple or k % group_size:
        raise ValueError(
            f"group_size must be a positive multiple of {multiple} dividing the input size "
            f"{k} for int{bits}, got {group_size}"
        )
    w = weight.detach().float().reshape(n, k // group_size, group_size)
    offsets = None
    if bits == 8 and symmetric:
        # llama.cpp's Q8_0: integers from the float32 scale, rounded half away from zero.
        scale = w.abs().amax(-1) / 127.0
        q = _round_away(w * _inverse(scale)[..., None]).clamp_(-127, 127).to(torch.int8)
        scale = _f16(scale)
    elif bits == 4 and symmetric:
        # llama.cpp's Q4_0: the value of largest magnitude maps to -8 (the wider side of 0..15).
        extreme = w.gather(-1, w.abs().argmax(-1, keepdim=True)).squeeze(-1)
        scale = extreme / -8.0
        q = torch.trunc(w * _inverse(scale)[..., None] + 8.5).clamp_(0, 15).to(torch.uint8)
        scale = _f16(scale)
    else:
        low, high = w.amin(-1), w.amax(-1)
        levels, least = (255.0, -128.0) if bits == 8 else (15.0, 0.0)
        scale = _f16((high - low) / levels)
        # int8 is stored signed: the offset absorbs the shift, so q runs over -128..127.
        offset = _f16(low - least * scale.float())
        q = torch.round((w - offset.float()[..., None]) / _safe(scale)[..., None])
        q = q.clamp_(least, least + levels).to(torch.int8 if bits == 8 else torch.uint8)
        offsets = offset.reshape(n, -1).contiguous()
    q = q.reshape(n, k)
    qweight = q.contiguous() if bits == 8 else pack_int4(q)
    return QuantizedWeight(
        qweight=qweight,
        scales=scale.reshape(n, -1).contiguous(),
        offsets=offsets,
        bits=bits,
        group_size=group_size,
        shape=(n, k),
    )


def _f16(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.float16)


def _inverse(scale: torch.Tensor) -> torch.Tensor:
    """1 / scale, 0 where the scale is 0 (an all-zero group quantizes to zeros)."""
    return torch.where(scale == 0, torch.zeros_like(scale), 1.0 / scale)


def _round_away(values: torch.Tensor) -> torch.Tensor:
    """C's roundf: halves away from zero (torch.round rounds them to even)."""
    return torch.trunc(values + 0.5 * torch.sign(values))


def _safe(scale: torch.Tensor) -> torch.Tensor:
    """Scales as float32 with zeros replaced by 1 (an all-zero group quantizes to zeros)."""
    s = scale.float()
    return torch.where(s == 0, torch.ones_like(s), s)
