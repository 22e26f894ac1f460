"""FP8 models loaded: "fp8" checkpoints (block-scaled `weight` + `weight_scale_inv`, HF
transformers' fine-grained FP8 layout) and float checkpoints quantized on load
(`quantization="fp8"`), their linear layers given `FP8Weight`s (`fp8`).

As for the integer formats (`prequantized`), `FP8Checkpoint.wrap` sits between the checkpoint
and the model's `load_weights`: each quantized layer's `weight` and `weight_scale_inv` become
the dense `weight` the model loads (so fused q/k/v and gate/up shards, TP and MoE experts load
as they always do), and the fp8 tensors are recorded. `install` then puts each layer's records
(a fused layer's parts stacked, or side by side where a part's rows end inside a block) in its
`quant_weight`, with the FP8 method. Layers without a `weight_scale_inv` (norms, embeddings, the LM head, the
config's `modules_to_not_convert`) stay dense. MoE experts are dequantized to the model's dtype
at load (their records are not used): `FusedMoE` has no FP8 path.

Under tensor parallelism each rank keeps its slice of a record: rows of column-parallel layers,
columns of row-parallel ones, which must fall on the checkpoint's block boundaries (a slice
cutting a block would need that block's scale on two ranks): otherwise loading stops, naming
the layer. On CPU the layers keep their fp8 bytes where the C kernel (`native.fp8_gemv`) builds, else
they are dequantized to the model's dtype once at load (`keep_fp8_on_cpu`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from tokenwise import envs
from tokenwise.layers.quantization.base_config import is_linear
from tokenwise.layers.quantization.fp8 import FP8_DTYPE, FP8Weight, quantize_fp8
from tokenwise.layers.quantization.linear_methods import FP8_LINEAR, use_quantized_weight
from tokenwise.layers.quantization.schemes import ROUTERS
from tokenwise.layers.quantization.tp_slice import RankSlices
from tokenwise.layers.quantization.weight_only import QuantizedParts
from tokenwise.layers.weight_utils import (
    CheckpointTensor,
    StackedMapping,
    checkpoint_names,
    materialize,
)
from tokenwise.native import fp8_gemv as cpu_fp8
from tokenwise.platform import release_freed_memory
from tokenwise.quantization_config import FP8CheckpointConfig

logger = logging.getLogger(__name__)

# (layer name, layer) -> its FP8 record, or None where it stays dense.
RecordFor = Callable[[str, nn.Module], "FP8Weight | QuantizedParts | None"]

SCALE = "weight_scale_inv"
# A static activation scheme's per-layer input scales: read and dropped (activations are
# quantized dynamically per token on a GPU, kept in floating point on CPU).
INPUT_SCALES = ("input_scale", "activation_scale")


def keeps_fp8(device: torch.device) -> bool:
    """Whether FP8 layers on `device` keep their fp8 bytes (else dequantized once at load)."""
    return device.type != "cpu" or keep_fp8_on_cpu()


def keep_fp8_on_cpu() -> bool:
    """`TOKENWISE_CPU_FP8_WEIGHTS`: "fp8" (fp8 bytes kept: half bf16's memory; the C kernel
    at decode, the weight dequantized per call for prefill), "dense" (dequantized once at load:
    bf16's memory and speed), or "auto" (default: "fp8" where the C kernel `native.fp8_gemv` builds,
    since without it each call dequantizes with torch ops, 50-100x slower than bf16)."""
    setting = envs.get("TOKENWISE_CPU_FP8_WEIGHTS").strip().lower()
    if setting not in ("auto", "dense", "fp8"):
        raise ValueError(
            f"TOKENWISE_CPU_FP8_WEIGHTS must be 'auto', 'dense' or 'fp8', got {setting!r}"
        )
    if setting == "auto":
        return cpu_fp8.load() is not None
    return setting == "fp8"


class FP8Checkpoint:
    """Reads an "fp8" checkpoint's quantized layers while it loads; keeps their fp8 records."""

    def __init__(self, model: nn.Module, config: FP8CheckpointConfig, keep: bool) -> None:
        self.config = config
        self.keep = keep  # False: layers stay dense (CPU default), no record is kept
        self.mapping: StackedMapping = getattr(model, "stacked_params_mapping", ())
        self.param_names = {id(p): name for name, p in model.named_parameters()}
        self.slices = RankSlices(model, self.mapping)
        self.records: dict[str, FP8Weight] = {}

    def wrap(
        self, weights: Iterable[tuple[str, CheckpointTensor]], names: Iterable[str]
    ) -> Iterator[tuple[str, CheckpointTensor]]:
        """`weights` with each quantized layer's `weight` + `weight_scale_inv` replaced by its
        dense float32 `weight`, yielded once both have been read."""
        names = set(names)
        quantized = {n.rpartition(".")[0] for n in names if n.endswith("." + SCALE)}
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in weights:
            layer, _, suffix = name.rpartition(".")
            if suffix in INPUT_SCALES:
                continue
            if layer not in quantized or suffix not in ("weight", SCALE):
                if suffix == "weight" and _is_fp8(tensor):
                    raise ValueError(
                        f"checkpoint tensor {name} is float8 but {layer}.{SCALE} is missing"
                    )
                yield name, tensor
                continue
            parts = pending.setdefault(layer, {})
            parts[suffix] = materialize(tensor)
            if len(parts) == 2:
                del pending[layer]
                yield f"{layer}.weight", self._convert(layer, parts, names)
        if pending:
            layer = next(iter(pending))
            raise ValueError(f"checkpoint tensor {layer}.weight is missing (it has a {SCALE})")

    def _convert(self, layer: str, parts: dict[str, torch.Tensor], names: set[str]) -> torch.Tensor:
        if self.config.static_activations and not any(
            f"{layer}.{s}" in names for s in INPUT_SCALES
        ):
            raise ValueError(
                f"activation_scheme is 'static' but {layer} has no input_scale (or activation_scale)"
            )
        weight, scale = parts["weight"], parts[SCALE].float()
        if weight.dtype != FP8_DTYPE:
            raise ValueError(f"{layer}.weight is {weight.dtype}, not float8_e4m3fn")
        if weight.dim() != 2:
            return _dequantize_stacked(layer, weight, scale, self.config.block)
        scale = scale.reshape(1, 1) if scale.numel() == 1 else scale
        block = None if scale.numel() == 1 else self.config.block
        try:
            record = FP8Weight(weight.contiguous(), scale.contiguous(), tuple(weight.shape), block)
        except ValueError as e:
            raise ValueError(f"{layer}.{SCALE}: {e} (weight_block_size={block})") from e
        if self.keep:
            self.records[f"{layer}.weight"] = rank_slice(f"{layer}.weight", self.slices, record)
        return record.dequantize(torch.float32)

    def record_for(self, name: str, module: nn.Module) -> FP8Weight | QuantizedParts | None:
        """The layer's record, its fused parts stacked; None where a part has none."""
        parts = list(checkpoint_names(self.param_names[id(module.weight)], self.mapping).values())
        found = [self.records.pop(part, None) for part in parts]
        if not found or any(r is None for r in found):
            return None
        return combine([r for r in found if r is not None])


def _is_fp8(tensor: CheckpointTensor) -> bool:
    """Whether a checkpoint tensor (read, or lazily under TP) is float8_e4m3fn."""
    if isinstance(tensor, torch.Tensor):
        return tensor.dtype == FP8_DTYPE
    return getattr(tensor, "stored_dtype", None) == "F8_E4M3"


def combine(parts: list[FP8Weight]) -> FP8Weight | QuantizedParts:
    """A fused layer's parts as one record (rows stacked, where every part's rows end on a
    block boundary), else side by side (`QuantizedParts`: one product per part)."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    same = all(p.block == first.block and p.kind == first.kind for p in parts)
    aligned = first.block is None or all(p.shape[0] % first.block[0] == 0 for p in parts[:-1])
    if not same or not aligned or first.kind == "tensor":
        return QuantizedParts(parts)  # type: ignore[arg-type]
    return FP8Weight(
        torch.cat([p.weight for p in parts]),
        torch.cat([p.scale for p in parts]),
        (sum(p.shape[0] for p in parts), first.shape[1]),
        first.block,
    )


def rank_slice(name: str, slices: RankSlices, record: FP8Weight) -> FP8Weight:
    """This rank's slice of a record, cut as the layer's weight loader cuts the dense weight;
    a slice that would cut a block is refused, naming the layer."""
    owner = slices.owners.get(name)
    if owner is None or getattr(owner[1], "tp_size", 1) == 1:
        return record
    layer, module, shard, count = owner
    if hasattr(module, "source_rows"):
        if count == 1 and len(module.full_output_sizes) > 1:
            raise ValueError(f"{name}: a fused fp8 checkpoint tensor under tensor parallelism")
        start, size = module.source_rows(0 if shard is None else module.shard_index(shard))
        return _cut(name, record, 0, start, size)
    if hasattr(module, "source_columns"):
        return _cut(name, record, 1, *module.source_columns())
    raise ValueError(f"{name}: {type(module).__name__} has no fp8 tensor-parallel layout")


def _cut(name: str, record: FP8Weight, dim: int, start: int, size: int) -> FP8Weight:
    total = record.shape[dim]
    scale = record.scale
    if record.block is not None:
        b = record.block[dim]
        if start % b or (size % b and start + size != total):
            what = "rows" if dim == 0 else "columns"
            raise ValueError(
                f"{name}: this rank's {what} {start}..{start + size} cut the checkpoint's "
                f"{b}-wide fp8 blocks; choose a tensor_parallel_size whose slices hold whole blocks"
            )
        scale = scale.narrow(dim, start // b, -(-size // b))
    elif dim == 0 and scale.shape[0] > 1:
        scale = scale.narrow(0, start, size)
    weight = record.weight.narrow(dim, start, size).contiguous()
    shape = (size, record.shape[1]) if dim == 0 else (record.shape[0], size)
    return FP8Weight(weight, scale.contiguous(), shape, record.block)


def _dequantize_stacked(
    layer: str, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None
) -> torch.Tensor:
    """A stacked tensor (fused MoE experts `[E, N, K]`), dequantized expert by expert."""
    scale = scale.reshape(weight.shape[0], 1, 1) if scale.numel() == weight.shape[0] else scale
    out = []
    for e in range(weight.shape[0]):
        s = scale[e] if scale[e].numel() > 1 else scale[e].reshape(1, 1)
        shape = tuple(weight.shape[1:])
        out.append(FP8Weight(weight[e], s, shape, block if s.numel() > 1 else None).dequantize())
    return torch.stack(out)


def install(model: nn.Module, record_for: RecordFor, keep_fp8: bool) -> int:
    """Give every linear layer `record_for` has a record that record and the FP8 method
    (`linear_methods.FP8_LINEAR`), or, unless `keep_fp8`, the record's values as its dense
    weight; returns how many. Embeddings and LM heads are not touched."""
    count = fp8_bytes = dense_bytes = 0
    for name, module in model.named_modules():
        weight = module._parameters.get("weight") if is_linear(module) else None
        if weight is None or weight.dim() != 2 or hasattr(module, "vocab_start"):
            continue
        record = record_for(name, module)
        if record is None:
            continue
        fp8_bytes += record.nbytes
        dense_bytes += weight.numel() * weight.element_size()
        if keep_fp8:
            use_quantized_weight(module, FP8_LINEAR, record)
            meta = torch.empty(weight.shape, dtype=weight.dtype, device="meta")
            module.weight = nn.Parameter(meta, requires_grad=False)
        else:  # a plain dense layer again, with the fp8 values: the bf16 kernels apply
            with torch.no_grad():
                weight.copy_(record.dequantize(weight.dtype))
        count += 1
    if count:
        release_freed_memory()
        held = "kept as fp8" if keep_fp8 else "dequantized once to the model's dtype (CPU)"
        logger.info(
            "fp8: %d linear layers, %.1f MiB of fp8 weights (%.1f MiB dense), %s",
            count, fp8_bytes / 2**20, dense_bytes / 2**20, held,
        )  # fmt: skip
    return count


def quantize_on_load(model: nn.Module, keep_fp8: bool, per_channel: bool = False) -> int:
    """`quantization="fp8"` over a float checkpoint: every linear layer but the MoE routers
    and the LM head, per-tensor scales (vLLM's default) or per output channel."""

    def record_for(name: str, module: nn.Module) -> FP8Weight | None:
        if name.rpartition(".")[2] in ROUTERS:
            return None
        return quantize_fp8(module.weight, per_channel)

    return install(model, record_for, keep_fp8)
