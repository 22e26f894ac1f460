"""Each quantized layer's route on a GPU, chosen at load: tinygemm only where it proved right.

Why a self-check: tinygemm's packed layout (the nibble order of its uint8 input, its tiles) is
read from torch's source, and a wrong guess would give plausible wrong numbers, not an error.
So before any layer of a format uses the kernel, `prepare_model` runs the packed kernel, on the
device, for each distinct format (shape, group size, offsets or not, scale dtype) on one of
its layers and compares the result with the definition (`reference_dequantize`, float32):
- rows of the identity for a sample of columns (the first 64, the last 32 and 32 others) read
  those columns of the weight back one value at a time: each must be within
  `2^-8 * (8 |s| + |zero| + |w|)` of the definition (the bfloat16 rounding of the scale, the
  zero and the output, each relative 2^-9, doubled), well under one step `s` of the integers,
  so any value taken from the wrong place (a different integer) fails;
- 8 random rows check the whole product: relative Frobenius error at most `RANDOM_TOLERANCE`.
On a mismatch or an exception the format is logged once (naming the layer and why) and its
layers are dequantized per call instead (`gpu_weight_only`): correct, slower, integers kept.
Layers that pass drop their own integers (the kernel's copy is the one kept), except a weight
shared with a quantized embedding, whose lookups read the integers.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch
from torch import nn

from tokenwise.layers.quantization import gpu_int4
from tokenwise.layers.quantization.gpu_weight_only import KERNEL_DTYPES, int4_values
from tokenwise.layers.quantization.weight_only import (
    QuantizedParts,
    QuantizedWeight,
    _stored_reference,
)

logger = logging.getLogger(__name__)

RANDOM_TOLERANCE = 2e-2
PROBE_SEED = 0


def quantized_weights(model: nn.Module) -> Iterator[tuple[str, QuantizedWeight, bool, bool]]:
    """(layer name, weight, used by a linear layer, used by an embedding) of every
    `QuantizedWeight` the model's layers hold, each once (a tied embedding and LM head share
    one)."""
    found: dict[int, list] = {}
    for name, module in model.named_modules():
        for attr, in_table in (("quant_weight", False), ("quant_table", True)):
            held = getattr(module, attr, None)
            parts = held.parts if isinstance(held, QuantizedParts) else [held]
            for part in parts:
                if isinstance(part, QuantizedWeight):
                    entry = found.setdefault(id(part), [name, part, False, False])
                    entry[3 if in_table else 2] = True
    for name, weight, in_linear, in_table in found.values():
        yield name, weight, in_linear, in_table


def move_to(weight: QuantizedWeight, device: torch.device) -> None:
    """The weight's tensors onto `device` (records are read on the CPU)."""
    for attr in ("qweight", "scales", "offsets", "input_perm"):
        tensor = getattr(weight, attr)
        if tensor is not None and tensor.device != device:
            setattr(weight, attr, tensor.to(device))


def prepare_model(
    model: nn.Module,
    device: torch.device,
    dtype: torch.dtype,
    ops: gpu_int4.Int4Ops = gpu_int4.CUDA_OPS,
) -> dict[str, int]:
    """Move every quantized weight to `device` and give the int4 layers that pass the
    self-check their kernel; returns how many layers took each route. A model whose dtype
    the kernel does not take (float32: bfloat16 products would undo its precision) gets
    per-call dequantization everywhere."""
    verdicts: dict[tuple, str | None] = {}
    routes = {"kernel": 0, "dequantize": 0}
    use_kernel = dtype in KERNEL_DTYPES
    for name, weight, in_linear, in_table in quantized_weights(model):
        move_to(weight, device)
        if in_linear:  # an embedding's own table is read by rows, never multiplied
            picked = use_kernel and choose(name, weight, ops, verdicts, keep_integers=in_table)
            routes["kernel" if picked else "dequantize"] += 1
    if routes["kernel"] or routes["dequantize"]:
        logger.info(
            "quantized layers on %s: %d through %s, %d dequantized per call",
            device,
            routes["kernel"],
            ops.name,
            routes["dequantize"],
        )
    return routes


def choose(
    name: str,
    weight: QuantizedWeight,
    ops: gpu_int4.Int4Ops,
    verdicts: dict[tuple, str | None],
    keep_integers: bool = False,
) -> bool:
    """Give `weight` its kernel where its format fits and passed the self-check (run once per
    format, remembered in `verdicts`: format -> None or why it failed); True if it did."""
    reason = gpu_int4.unfit_reason(weight.bits, weight.group_size, weight.shape)
    if reason is not None:
        logger.debug("%s (%s) is dequantized per call: %s", name, weight.describe(), reason)
        return False
    key = (weight.shape, weight.group_size, weight.offsets is None, weight.scales.dtype)
    kernel, failure = None, None
    try:
        kernel = gpu_int4.pack(
            int4_values(weight.qweight), weight.scales, weight.offsets, weight.group_size, ops
        )
    except (RuntimeError, ValueError, NotImplementedError) as e:
        failure = f"packing raised {str(e).splitlines()[0]}"
    if key not in verdicts:
        verdicts[key] = failure if kernel is None else self_check(weight, kernel)
        if verdicts[key] is not None:
            logger.warning(
                "%s: %s failed its self-check on %s (%s, %s); layers of this format are "
                "dequantized per call instead",
                name,
                ops.name,
                weight.qweight.device,
                weight.describe(),
                verdicts[key],
            )
    if verdicts[key] is not None or kernel is None:
        return False
    weight.device_kernel = kernel
    if not keep_integers:
        weight.qweight = weight.qweight.new_empty(0)
        kernel.owns_integers = True
    return True


def probe_columns(k: int) -> torch.Tensor:
    """The columns the identity rows read: the first 64, the last 32 and 32 others."""
    generator = torch.Generator().manual_seed(PROBE_SEED)
    others = torch.randint(0, k, (32,), generator=generator)
    picked = torch.cat((torch.arange(min(k, 64)), torch.arange(max(0, k - 32), k), others))
    return torch.unique(picked)


def self_check(weight: QuantizedWeight, kernel: gpu_int4.Int4Kernel) -> str | None:
    """None where the kernel reproduces the weight (module docstring), else why not."""
    n, k = weight.shape
    device = weight.qweight.device
    reference = _stored_reference(weight).to(device)  # float32 [N, K], storage order
    columns = probe_columns(k).to(device)
    generator = torch.Generator().manual_seed(PROBE_SEED)
    random_rows = torch.randn(8, k, generator=generator).to(device, torch.bfloat16)
    eye = torch.zeros(columns.numel(), k, dtype=torch.bfloat16, device=device)
    eye[torch.arange(columns.numel(), device=device), columns] = 1.0
    try:
        out = kernel.mm(torch.cat((eye, random_rows))).float()
    except (RuntimeError, ValueError, NotImplementedError) as e:
        return f"the kernel raised {str(e).splitlines()[0]}"
    if tuple(out.shape) != (columns.numel() + 8, n):
        return f"the kernel returned shape {tuple(out.shape)}"
    read = out[: columns.numel()].t()  # [N, columns]
    expected = reference[:, columns]
    s = weight.scales.float().repeat_interleave(weight.group_size, 1)[:, columns]
    zero = gpu_int4.scales_and_zeros(weight.scales, weight.offsets, torch.float32)
    z = zero[..., 1].t().repeat_interleave(weight.group_size, 1)[:, columns]
    bound = 2.0**-8 * (8 * s.abs() + z.abs() + expected.abs()) + 1e-6
    bad = (read - expected).abs() > bound
    if bool(bad.any()):
        row, col = (int(i) for i in bad.nonzero()[0])
        return (
            f"{int(bad.sum())} of {bad.numel()} weight values read back wrong, e.g. "
            f"[{row}, {int(columns[col])}]: {read[row, col].item():.6g} instead of "
            f"{expected[row, col].item():.6g}"
        )
    product = random_rows.float() @ reference.t()
    error = float((out[columns.numel() :] - product).norm() / product.norm().clamp_min(1e-30))
    if not error <= RANDOM_TOLERANCE:
        return f"relative error {error:.3g} on random inputs (tolerance {RANDOM_TOLERANCE})"
    return None
