"""FP8 (float8_e4m3fn) linear weights: per-tensor, per-output-channel or block scales.

Formats held (`FP8Weight.scale`, float32, `weight` float8_e4m3fn `[N, K]`):
- per-tensor: one scale `[1, 1]` (vLLM's default for `quantization="fp8"` on load);
- per-channel: one scale per output row `[N, 1]` (compressed-tensors' channel strategy);
- block: one scale per `[bn, bk]` tile, `[ceil(N / bn), ceil(K / bk)]` (DeepSeek-V3 / Qwen3-FP8's
  "fine-grained" `weight_scale_inv`, [128, 128]); the last tiles of a row or column may be partial.
The dense weight is `weight * scale` of its tile, in float32 (`dequantize`).

How a layer computes (`linear`):
- CUDA: W8A8 with `torch._scaled_mm`. Activations are quantized dynamically to e4m3, per token
  (and per group of `bk` columns with block scales, as DeepSeek-V3 does): `x = xq * sx`. Per-tensor
  and per-channel weights run `_scaled_mm`'s row-wise scaling (`sx [M, 1]`, the weight's scale
  broadcast to `[1, N]`); block weights its (1x128, 128x128) block scaling, which torch 2.13 has
  on Hopper with recent CUDA only: where it raises, or blocks are not 128x128, or shapes are not
  multiples of 16, the layer falls back (logged once) to its weight dequantized per call in the
  activations' dtype. Unverified on a GPU so far (tests/test_gpu_path.py has the checks).
- CPU: weight-only, activations stay in floating point. Up to 8 rows (decode) run the C kernel
  `native.fp8_gemv` over the fp8 bytes (half bf16's memory traffic); more rows (prefill) dequantize the
  weight per call (by the same kernels) and run torch's matmul. torch's own routes are far
  slower (`benchmarks/fp8_linear.py`, Llama-100m shapes, one row: its fp8 -> bf16 conversion and
  its CPU `_scaled_mm` take 25-100x a bf16 layer's time), so without the kernel the loader
  dequantizes CPU layers once instead (`fp8_loading.keep_fp8_on_cpu`): plain dense layers, the
  model dtype's memory and speed.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenwise.native import fp8_gemv as cpu_fp8

logger = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# Smallest scale an all-zero row or tile gets, so that dividing by it stays finite.
MIN_SCALE = 1e-12


@dataclass(eq=False)
class FP8Weight:
    """One layer's FP8 weight; a linear layer holds it in `quant_weight` (`QuantizedWeight`'s
    interface: `linear`, `nbytes`, `describe`, `dequantize`)."""

    weight: torch.Tensor  # float8_e4m3fn [N, K]
    scale: torch.Tensor  # float32 [1, 1], [N, 1] or [ceil(N / bn), ceil(K / bk)]
    shape: tuple[int, int]
    block: tuple[int, int] | None = None  # (bn, bk) for block scales

    def __post_init__(self) -> None:
        if self.weight.dtype != FP8_DTYPE:
            raise ValueError(f"weight must be float8_e4m3fn, got {self.weight.dtype}")
        if tuple(self.weight.shape) != tuple(self.shape):
            raise ValueError(f"weight {tuple(self.weight.shape)} is not shape {self.shape}")
        if self.scale.dtype != torch.float32 or self.scale.dim() != 2:
            raise ValueError("scale must be a 2-D float32 tensor")
        n, k = self.shape
        expected = [(1, 1), (n, 1)]
        if self.block is not None:
            bn, bk = self.block
            expected = [(math.ceil(n / bn), math.ceil(k / bk))]
        if tuple(self.scale.shape) not in expected:
            raise ValueError(
                f"scale {tuple(self.scale.shape)} does not fit a {self.kind} scaled [{n}, {k}] "
                f"weight; expected one of {expected}"
            )

    @property
    def kind(self) -> str:
        if self.block is not None:
            return "block"
        return "tensor" if self.scale.numel() == 1 else "channel"

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.scale))

    def describe(self) -> str:
        what = f"block {self.block[0]}x{self.block[1]}" if self.block else f"per-{self.kind}"
        return f"fp8 e4m3, {what} scales"

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense weight `[N, K]` in `dtype`: each value times its tile's (row's) scale."""
        lib = self._cpu_kernels() if dtype in (torch.float32, torch.bfloat16) else None
        if lib is not None:
            return cpu_fp8.dequantize(lib, self.weight, self.scale, self.kind, self.block, dtype)
        return (self.weight.float() * self._full_scale()).to(dtype)

    def _cpu_kernels(self):  # noqa: ANN202 (ctypes.CDLL | None)
        """The C kernels (`native.fp8_gemv`) where they take this CPU weight, else None."""
        if self.weight.device.type != "cpu":
            return None
        if torch.compiler.is_compiling():  # ctypes calls cannot be traced
            return None
        return cpu_fp8.load() if cpu_fp8.fits(self.shape, self.block) else None

    def _full_scale(self) -> torch.Tensor:
        """float32 scale per weight value (`[N, K]`, or broadcastable to it)."""
        if self.block is None:
            return self.scale
        n, k = self.shape
        bn, bk = self.block
        return self.scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """`x @ W^T + bias` in x's dtype: W8A8 on CUDA, weight-only elsewhere (module doc)."""
        if x.is_cuda and _scaled_mm_fits(self, x):
            try:
                return scaled_linear(x, self, bias)
            except (RuntimeError, ValueError, NotImplementedError) as e:  # no kernel here
                _fall_back(self, e)
        if x.dtype in (torch.float32, torch.bfloat16):
            rows = x.numel() // self.shape[1]
            lib = self._cpu_kernels() if 0 < rows <= cpu_fp8.MAX_ROWS else None
            if lib is not None:
                args = (self.weight, self.scale, self.kind, self.block, bias)
                return cpu_fp8.gemv(lib, x, *args)
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        lib = self._cpu_kernels() if x.dtype in (torch.float32, torch.bfloat16) else None
        if lib is None:
            return F.linear(x, self.dequantize(x.dtype), bias)
        out = cpu_fp8.scratch(*self.shape, x.dtype)
        args = (self.weight, self.scale, self.kind, self.block, x.dtype, out)
        return F.linear(x, cpu_fp8.dequantize(lib, *args), bias)


def quantize_fp8(weight: torch.Tensor, per_channel: bool = False) -> FP8Weight:
    """Round-to-nearest e4m3 of a dense `[N, K]` weight: the largest magnitude (of the tensor,
    or of each row) maps to 448, vLLM's on-load `fp8` (per-tensor by default)."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax().reshape(1, 1)
    scale = (amax / FP8_MAX).clamp(min=MIN_SCALE)
    q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return FP8Weight(q.contiguous(), scale.contiguous(), (w.shape[0], w.shape[1]))


def quantize_activations(x: torch.Tensor, group: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic e4m3 quantization of `x [M, K]`, per row (`group=None`, scales `[M, 1]`) or per
    row and group of `group` columns (scales `[M, ceil(K / group)]`, the last group partial)."""
    m, k = x.shape
    xf = x.float()
    if group is None:
        scale = (xf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
        return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
    groups = math.ceil(k / group)
    padded = F.pad(xf, (0, groups * group - k)).reshape(m, groups, group)
    scale = (padded.abs().amax(dim=2) / FP8_MAX).clamp(min=MIN_SCALE)
    full = scale.repeat_interleave(group, 1)[:, :k]
    return (xf / full).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def scaled_linear(x: torch.Tensor, w: FP8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """W8A8 `x @ W^T + bias` through `torch._scaled_mm`, in x's dtype. Per-tensor / per-channel
    weights also run on CPU (row-wise scales), which is how the tests check the scale layout."""
    n, k = w.shape
    x2 = x.reshape(-1, k)
    out_dtype = x.dtype
    if bias is not None and bias.dtype != out_dtype:
        bias = bias.to(out_dtype)
    if w.block is None:
        xq, sx = quantize_activations(x2, None)
        sw = w.scale.reshape(1, -1).expand(1, n).contiguous()
        out = torch._scaled_mm(
            xq, w.weight.t(), scale_a=sx, scale_b=sw, bias=bias, out_dtype=out_dtype
        )
    else:
        # DeepSeek-V3's recipe, torch's (1x128, 128x128) block scaling: the activations' scales
        # outer-dim-major ([M, K / 128] with stride (1, M)); the weight's transposed to
        # [K / 128, N / 128], K padded to a multiple of 4 as cuBLAS reads them.
        xq, sx = quantize_activations(x2, w.block[1])
        sx = sx.t().contiguous().t()
        sw = w.scale
        pad = (-sw.shape[1]) % 4
        sw = (F.pad(sw, (0, pad)) if pad else sw).contiguous().t()
        out = F.scaled_mm(
            xq,
            w.weight.t(),
            sx,
            F.ScalingType.BlockWise1x128,
            sw,
            F.ScalingType.BlockWise128x128,
            output_dtype=out_dtype,
        )
        out = out if bias is None else out + bias
    return out.reshape(*x.shape[:-1], n)


def _scaled_mm_fits(w: FP8Weight, x: torch.Tensor) -> bool:
    """Whether `_scaled_mm` may take this layer: fp8 GEMMs need K and N multiples of 16, 16-bit
    or float32 outputs, and torch's block scaling takes 128x128 tiles only."""
    if getattr(w, "_no_scaled_mm", False) or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    n, k = w.shape
    return n % 16 == 0 and k % 16 == 0 and w.block in (None, (128, 128))


def _fall_back(w: FP8Weight, error: Exception) -> None:
    w._no_scaled_mm = True  # type: ignore[attr-defined]
    logger.warning(
        "torch._scaled_mm refused a %s FP8 layer %s (%s); it dequantizes its weight per call",
        w.describe(),
        w.shape,
        str(error).splitlines()[0],
    )
