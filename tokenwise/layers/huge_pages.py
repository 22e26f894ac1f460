"""A CPU model's weights moved onto transparent huge pages once it is loaded (and packed).

Batch-1 decode reads every weight once per step; from 4 KB pages that is a TLB miss and a
stalled hardware prefetcher every 4 KB (`platform.huge_page_buffer` has the measurement).
Copying each large weight into memory advised for 2 MB pages before it is first touched is
the one move that fixes it for every path at once: dense and quantized linear layers, their
packed forms, embeddings and experts.

What moves: parameters, buffers and tensor attributes of modules (a layer's `packed_weight`),
and the integers, scales and offsets of quantized weights (a layer's `quant_weight`), each at least `MIN_BYTES`
and owning its whole storage. Tensors that share storage (a tied embedding and LM head, views
of a fused weight) move once, together, or not at all, so aliasing is kept. A weight that is a
view into a bigger storage stays where it is. `TOKENWISE_CPU_HUGE_PAGES=0` switches it off.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from tokenwise import envs
from tokenwise.layers.quantization.weight_only import (
    QuantizedExperts,
    QuantizedParts,
    QuantizedWeight,
)
from tokenwise.platform import HUGE_PAGE, on_huge_pages, release_freed_memory

logger = logging.getLogger(__name__)

MIN_BYTES = HUGE_PAGE  # smaller tensors would waste most of their 2 MB page


def enabled() -> bool:
    setting = envs.get("TOKENWISE_CPU_HUGE_PAGES").strip().lower()
    return setting not in ("0", "false", "off", "no")


def move_weights_to_huge_pages(model: nn.Module) -> int:
    """Move `model`'s large CPU weights onto huge pages; returns the bytes moved."""
    if not enabled():
        return 0
    moved: dict[int, torch.Tensor] = {}  # storage address (old and new) -> its new tensor
    totals = [0, 0]  # bytes, tensors

    def move(tensor: torch.Tensor) -> torch.Tensor:
        if not _movable(tensor):
            return tensor
        key = tensor.untyped_storage().data_ptr()
        if key not in moved:
            new = on_huge_pages(tensor)
            moved[key] = moved[new.untyped_storage().data_ptr()] = new  # met again: stays
            if new is not tensor:
                totals[0] += new.numel() * new.element_size()
                totals[1] += 1
        return moved[key]

    for module in model.modules():
        for param in module.parameters(recurse=False):
            new = move(param.data)
            if new is not param.data:
                param.data = new
        for name, buffer in module.named_buffers(recurse=False):
            new = move(buffer)
            if new is not buffer:
                module._buffers[name] = new
        for name, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                setattr(module, name, move(value))
            else:
                _move_quantized(value, move)
    if totals[0]:
        release_freed_memory()
    logger.info("weights on huge pages: %.1f MiB in %d tensors", totals[0] / 2**20, totals[1])
    return totals[0]


def _movable(tensor: torch.Tensor) -> bool:
    nbytes = tensor.numel() * tensor.element_size()
    return (
        tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and not tensor.is_mkldnn
        and nbytes >= MIN_BYTES
        and tensor.is_contiguous()
        and tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == nbytes  # owns its whole storage
    )


def _move_quantized(value: object, move) -> None:
    """The tensors of a quantized weight (or of each part / expert) in place."""
    if isinstance(value, QuantizedWeight):
        for field in ("qweight", "scales", "offsets"):
            tensor = getattr(value, field)
            if tensor is not None:
                setattr(value, field, move(tensor))
    elif isinstance(value, QuantizedParts):
        for part in value.parts:
            _move_quantized(part, move)
    elif isinstance(value, QuantizedExperts):
        for weight in (*value.w13, *value.w2):
            _move_quantized(weight, move)
