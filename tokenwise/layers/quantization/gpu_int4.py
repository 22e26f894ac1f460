"""int4 weight-only layers on a GPU through torch's tinygemm kernel (`aten._weight_int4pack_mm`).

Why this kernel: it ships with torch (no build step), reads the weight in 4 bits (decode reads
~28% of bf16's bytes) and dequantizes in registers. What it takes (torch's `int4mm.cu`):
- activations bfloat16, contiguous `[M, K]`; the output is bfloat16 `[M, N]`;
- the weight repacked once, at load, by `aten._convert_weight_to_int4pack` from uint8 `[N, K / 2]`
  whose byte j holds value 2j in its high nibble and value 2j + 1 in its low one (gpt-fast's
  order; tokenwise stores GGUF's, so the values are unpacked and paired again);
  `innerKTiles` 2, 4 or 8 with K a multiple of `innerKTiles * 16`, N a multiple of 8;
- groups of 32, 64, 128 or 256 values, and `scales_and_zeros` bfloat16 `[K / group, N, 2]` with
  `w = (q - 8) * scale + zero`. tokenwise's `w = q * s + o` is that with `zero = o + 8 s`
  (symmetric int4, `o = -8 s`: zero 0). Scales and zeros are rounded to bfloat16 here: the
  kernel's one approximation beyond the weights' own (relative 2^-9 of each).
Anything else (int8, other groups or shapes, float16 / float32 activations) takes the per-call
dequantization of `gpu_weight_only`.

The CUDA nibble order above is read from torch's source, not run here: `gpu_selfcheck` runs the
packed kernel on each distinct layer format at load and compares it with the definition before
any layer uses it. `Int4Ops` names the two ops so that tests can put torch's CPU twins in their
place (`_convert_weight_to_int4pack_for_cpu` takes int32 values `[N, K]` instead of bytes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

GROUP_SIZES = (32, 64, 128, 256)
N_TILE = 8  # the kernel's output rows per tile
K_TILE = 16  # its input columns per tile
INNER_K_TILES = (8, 4, 2)  # widest first: 16-byte loads where K allows


@dataclass(frozen=True)
class Int4Ops:
    """The packing op and the product op of one tinygemm implementation."""

    name: str
    # uint8 values [N, K] in 0..15 (input order within the stored columns), innerKTiles -> packed
    pack: Callable[[torch.Tensor, int], torch.Tensor]
    # (x bf16 [M, K], packed, group size, scales_and_zeros) -> bf16 [M, N]
    mm: Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor], torch.Tensor]


def _cuda_pack(values: torch.Tensor, inner: int) -> torch.Tensor:
    n, k = values.shape
    pairs = values.to(torch.uint8).reshape(n, k // 2, 2)
    nibbles = (pairs[..., 0] << 4) | pairs[..., 1]  # value 2j high, value 2j + 1 low
    return torch.ops.aten._convert_weight_to_int4pack(nibbles.contiguous(), inner)


def _cpu_pack(values: torch.Tensor, inner: int) -> torch.Tensor:
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        values.to(torch.int32).contiguous(), inner
    )


def _cuda_mm(x: torch.Tensor, packed: torch.Tensor, group: int, sz: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._weight_int4pack_mm(x, packed, group, sz)


def _cpu_mm(x: torch.Tensor, packed: torch.Tensor, group: int, sz: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, sz)


CUDA_OPS = Int4Ops("torch tinygemm (CUDA)", _cuda_pack, _cuda_mm)
CPU_TWIN_OPS = Int4Ops("torch tinygemm CPU twin", _cpu_pack, _cpu_mm)


def inner_k_tiles(k: int) -> int | None:
    """The widest `innerKTiles` whose tile width divides K; None where none does."""
    for inner in INNER_K_TILES:
        if k % (inner * K_TILE) == 0:
            return inner
    return None


def unfit_reason(bits: int, group_size: int, shape: tuple[int, int]) -> str | None:
    """Why tinygemm cannot take a layer of this format, or None where it can."""
    n, k = shape
    if bits != 4:
        return f"int{bits} (the kernel is int4 only)"
    if group_size not in GROUP_SIZES:
        return f"groups of {group_size} (the kernel takes {GROUP_SIZES})"
    if n % N_TILE:
        return f"{n} output rows (the kernel needs a multiple of {N_TILE})"
    if inner_k_tiles(k) is None:
        return f"input size {k} (the kernel needs a multiple of {INNER_K_TILES[-1] * K_TILE})"
    return None


def scales_and_zeros(
    scales: torch.Tensor, offsets: torch.Tensor | None, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """`[K / group, N, 2]` (scale, zero) of `w = (q - 8) * scale + zero` from tokenwise's
    `[N, K / group]` scales and offsets (`w = q * s + o`; no offsets: `o = -8 s`)."""
    s = scales.float()
    zero = torch.zeros_like(s) if offsets is None else offsets.float() + 8.0 * s
    return torch.stack((s, zero), dim=-1).transpose(0, 1).contiguous().to(dtype)


@dataclass(eq=False)
class Int4Kernel:
    """One layer's weight in tinygemm's layout (columns in the layer's storage order)."""

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor
    group_size: int
    shape: tuple[int, int]
    ops: Int4Ops
    # Set once the layer's own integers are dropped: the kernel then holds its only copy.
    owns_integers: bool = False

    @property
    def nbytes(self) -> int:
        parts = (self.packed, self.scales_and_zeros)
        return sum(t.numel() * t.element_size() for t in parts)

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """bf16 `x [..., K] @ W^T` -> bf16 `[..., N]` (x in storage column order)."""
        n, k = self.shape
        flat = x.reshape(-1, k)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        out = self.ops.mm(flat, self.packed, self.group_size, self.scales_and_zeros)
        return out.reshape(*x.shape[:-1], n)

    def dense(self, dtype: torch.dtype, chunk: int = 1024) -> torch.Tensor:
        """The weight `[N, K]` (storage order) as the kernel sees it, read back through the
        kernel with rows of the identity (where the integers live only in its layout)."""
        n, k = self.shape
        out = torch.empty(n, k, dtype=dtype, device=self.packed.device)
        for start in range(0, k, chunk):
            stop = min(start + chunk, k)
            eye = torch.zeros(stop - start, k, dtype=torch.bfloat16, device=self.packed.device)
            eye[:, start:stop].fill_diagonal_(1.0)
            out[:, start:stop] = self.mm(eye).t().to(dtype)
        return out


def pack(
    qvalues: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    group_size: int,
    ops: Int4Ops = CUDA_OPS,
) -> Int4Kernel:
    """tinygemm's weight from int4 values `[N, K]` (0..15, storage order) and their groups'
    scales and offsets; the format must fit (`unfit_reason`)."""
    n, k = qvalues.shape
    inner = inner_k_tiles(k)
    if inner is None or unfit_reason(4, group_size, (n, k)) is not None:
        raise ValueError(f"tinygemm cannot take int4 [{n}, {k}] in groups of {group_size}")
    packed = ops.pack(qvalues, inner)
    sz = scales_and_zeros(scales, offsets).to(packed.device)
    return Int4Kernel(packed, sz, group_size, (n, k), ops)
