"""Linear layers whose weights can be filled piece by piece from a Hugging Face checkpoint.

Checkpoints store q/k/v and gate/up as separate matrices, but one matmul over a fused weight is
faster than three (or two) small ones. The fused layers keep one weight and give each
checkpoint tensor a row range ("shard") to be copied into; `weight_loader` does that copy, so the
model's `load_weights` only has to say *which* shard a checkpoint tensor is.

Parameters are created with `torch.empty` so that they land in whatever default dtype and
device the loader set up: no fp32 copy is ever materialised for a bf16 model. The checked copy
itself (`copy_checked`, `default_weight_loader`) lives in `weight_utils`, shared with the models.

Under tensor parallelism (vLLM's layout) each layer holds a slice: column-parallel layers some
output rows (each part of a fused layer sliced separately, so rank r holds [q_r | k_r | v_r]
or [gate_r | up_r]), row-parallel layers some input columns, whose partial products are
all-reduced. Every layer reads its TP rank and size once, at construction. Loaders take the
full checkpoint tensor (possibly a `LazyTensor`, read only in this rank's slice) and copy this
rank's slice. With one rank every layer is an ordinary linear and no collective runs.

Each layer holds a `quant_method` (`layers.quantization`, vLLM's `LinearMethodBase`) that
creates its weights and computes its product: built with the dense method (whose CPU routes
include the oneDNN copy of the weight that `cpu_prepack` may put in `packed_weight`), a layer
gets a quantized method after loading when the model is quantized, its quantized weight then
in `quant_weight` and `weight` on the meta device (its shape and dtype still answer).

`lora` is empty unless LoRA serving is on: then it holds the layer's adapter slots
(`tokenwise.lora.layers.LoRASlots`), which add each token's adapter delta to the output, before
a row-parallel layer's all-reduce. The module stays where it is, so weight names never change.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from tokenwise.distributed.tp_state import get_tp_rank, get_tp_size, tp_all_reduce
from tokenwise.layers.quantization.base_config import LinearMethodBase
from tokenwise.layers.quantization.unquantized import UNQUANTIZED
from tokenwise.layers.weight_utils import (
    CheckpointTensor,
    check_full_shape,
    copy_checked,
    default_weight_loader,
)


def divide(count: int, what: str, tp_size: int | None = None) -> int:
    """`count / tensor_parallel_size`, refusing a count that does not split evenly."""
    size = get_tp_size() if tp_size is None else tp_size
    if count % size:
        raise ValueError(
            f"{what} ({count}) is not divisible by tensor_parallel_size ({size}); choose a "
            "tensor_parallel_size that divides it"
        )
    return count // size


def _tp_repr(layer: nn.Module) -> str:
    return f", tp_rank={layer.tp_rank} of {layer.tp_size}" if layer.tp_size > 1 else ""


class ReplicatedLinear(nn.Module):
    """`y = x W^T + b`, state-dict compatible with `nn.Linear`; the same on every TP rank."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.lora: nn.Module | None = None  # adapter slots, attached by the LoRA manager
        self.quant_method: LinearMethodBase = UNQUANTIZED  # replaced when quantized
        self.quant_weight: object = None  # a quantized method's weight
        self.quant_method.create_weights(self, input_size, output_size, bias, self.weight_loader)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: CheckpointTensor, shard_id: object = None
    ) -> None:
        default_weight_loader(param, loaded_weight, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.quant_method.apply(self, x, self.bias)
        return out if self.lora is None else self.lora(x, out)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"


class MergedColumnParallelLinear(ReplicatedLinear):
    """Several linears over the same input stacked along the output rows (e.g. gate_up_proj),
    each sliced over the TP ranks: rank r holds rows `[r*n/tp, (r+1)*n/tp)` of every part.

    `output_sizes` are the full part sizes (as in the checkpoint); `self.output_sizes` become
    this rank's. Shard ids are the positions in `output_sizes`: for gate_up, 0 is gate and 1 up.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool = False,
        *,
        what: str = "output size",
    ) -> None:
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        local = [divide(size, what, self.tp_size) for size in output_sizes]
        super().__init__(input_size, sum(local), bias)
        self.output_sizes = local
        self.full_output_sizes = list(output_sizes)

    def shard_rows(self, shard_id: int) -> tuple[int, int]:
        """(offset, size) of one shard's rows in the fused weight."""
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(
                f"shard id must be an int in [0, {len(self.output_sizes)}), got {shard_id!r}"
            )
        return sum(self.output_sizes[:shard_id]), self.output_sizes[shard_id]

    def shard_index(self, shard_id: object) -> int:
        """The position in `output_sizes` of a checkpoint shard id (`load_weights`' ids)."""
        return shard_id  # type: ignore[return-value]

    def source_rows(self, shard_id: int) -> tuple[int, int]:
        """(offset, size) of this rank's rows in the checkpoint tensor of shard `shard_id`."""
        size = self.output_sizes[shard_id]
        return self.tp_rank * size, size

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: CheckpointTensor, shard_id: object = None
    ) -> None:
        if shard_id is None:  # an already-fused checkpoint tensor: split it into its parts
            if self.tp_size == 1:
                copy_checked(param, loaded_weight)
                return
            check_full_shape(loaded_weight, (sum(self.full_output_sizes), *param.shape[1:]))
            start = 0
            for index, full in enumerate(self.full_output_sizes):
                self.weight_loader(param, loaded_weight.narrow(0, start, full), index)
                start += full
            return
        offset, size = self.shard_rows(shard_id)  # type: ignore[arg-type]
        source_offset, _ = self.source_rows(shard_id)  # type: ignore[arg-type]
        full = self.full_output_sizes[shard_id]  # type: ignore[index]
        # The whole checkpoint tensor must have the part's full shape, not just the slice.
        check_full_shape(loaded_weight, (full, *param.shape[1:]))
        copy_checked(
            param.data.narrow(0, offset, size), loaded_weight.narrow(0, source_offset, size)
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, parts={self.output_sizes}{_tp_repr(self)}"


class ColumnParallelLinear(MergedColumnParallelLinear):
    """One linear whose output rows are split over the TP ranks (its output stays sharded)."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, *, what: str = "output size"
    ) -> None:
        super().__init__(input_size, [output_size], bias, what=what)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: CheckpointTensor, shard_id: object = None
    ) -> None:
        if shard_id is not None:
            raise ValueError(f"this parameter is not fused; got shard id {shard_id!r}")
        super().weight_loader(param, loaded_weight, 0)


class QKVParallelLinear(MergedColumnParallelLinear):
    """The q, k and v projections as one matmul; with GQA k and v have fewer rows than q.

    Output columns are `[q (num_heads*head_dim) | k (num_kv_heads*head_dim) | v (same)]` for
    this rank's heads (`self.num_heads`, `self.num_kv_heads` are the local counts), which
    `split(self.output_sizes, dim=-1)` undoes in the attention module. Query heads are split
    over the TP ranks; KV heads too while there are at least as many as ranks (tp divides
    them), and beyond that replicated (tp a multiple of them): each rank holds the one KV head
    its query heads use, rank r reading KV head `r // (tp / num_kv_heads)`.
    """

    _SHARDS = {"q": 0, "k": 1, "v": 2}

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
    ) -> None:
        tp_rank, tp = get_tp_rank(), get_tp_size()
        self.tp_rank, self.tp_size = tp_rank, tp
        self.total_num_heads, self.total_num_kv_heads = num_heads, num_kv_heads
        self.num_heads = divide(num_heads, "num_attention_heads", tp)
        if tp <= num_kv_heads:
            self.num_kv_heads = divide(num_kv_heads, "num_key_value_heads", tp)
            self.kv_head_start = tp_rank * self.num_kv_heads
        else:
            if tp % num_kv_heads:
                raise ValueError(
                    f"tensor_parallel_size ({tp}) exceeds num_key_value_heads ({num_kv_heads}) "
                    "and is not a multiple of it, so KV heads cannot be replicated evenly"
                )
            self.num_kv_heads = 1
            self.kv_head_start = tp_rank // (tp // num_kv_heads)
        self.head_dim = head_dim
        local_q, local_kv = self.num_heads * head_dim, self.num_kv_heads * head_dim
        # Not MergedColumnParallelLinear.__init__: replicated KV heads do not divide evenly.
        ReplicatedLinear.__init__(self, hidden_size, local_q + 2 * local_kv, bias)
        self.output_sizes = [local_q, local_kv, local_kv]
        kv_size = num_kv_heads * head_dim
        self.full_output_sizes = [num_heads * head_dim, kv_size, kv_size]

    def source_rows(self, shard_id: int) -> tuple[int, int]:
        if shard_id == 0:
            return super().source_rows(0)
        return self.kv_head_start * self.head_dim, self.output_sizes[shard_id]

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: CheckpointTensor, shard_id: object = None
    ) -> None:
        index = None if shard_id is None else self.shard_index(shard_id)
        super().weight_loader(param, loaded_weight, index)

    def shard_index(self, shard_id: object) -> int:
        if isinstance(shard_id, int):
            return shard_id
        if shard_id not in self._SHARDS:
            raise ValueError(f"QKV shard id must be 'q', 'k' or 'v', got {shard_id!r}")
        return self._SHARDS[shard_id]  # type: ignore[index]

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, heads={self.num_heads}/{self.total_num_heads}, "
            f"kv_heads={self.num_kv_heads}/{self.total_num_kv_heads} from {self.kv_head_start}"
        )


class RowParallelLinear(ReplicatedLinear):
    """A linear whose input columns are split over the TP ranks (o_proj, down_proj): each rank
    multiplies its slice of the activations, and an all-reduce sums the partial products. The
    bias (replicated) is added once, after the sum.

    `reduce_results=False` skips the all-reduce (and then refuses a bias): the output is this
    rank's partial sum, for a caller that adds partials up itself (one all-reduce for two sums).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        *,
        reduce_results: bool = True,
        what: str = "input size",
    ) -> None:
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        if bias and not reduce_results and self.tp_size > 1:
            raise ValueError("a RowParallelLinear that does not reduce cannot add a bias once")
        super().__init__(divide(input_size, what, self.tp_size), output_size, bias)
        self.full_input_size = input_size
        self.reduce_results = reduce_results

    def source_columns(self) -> tuple[int, int]:
        """(offset, size) of this rank's columns in the checkpoint's weight (the quantized
        loaders slice a checkpoint's integers and scales by the same range)."""
        return self.tp_rank * self.input_size, self.input_size

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: CheckpointTensor, shard_id: object = None
    ) -> None:
        if param is self.weight and self.tp_size > 1:
            if shard_id is not None:
                raise ValueError(f"this parameter is not fused; got shard id {shard_id!r}")
            check_full_shape(loaded_weight, (self.output_size, self.full_input_size))
            loaded_weight = loaded_weight.narrow(1, *self.source_columns())
        default_weight_loader(param, loaded_weight, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super().forward(x)
        out = self.quant_method.apply(self, x, None)
        if self.lora is not None:
            out = self.lora(x, out)  # a partial sum too: the all-reduce completes it
        if not self.reduce_results:
            return out
        out = tp_all_reduce(out)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size} of {self.full_input_size}, out={self.output_size}, "
            f"bias={self.bias is not None}{_tp_repr(self)}"
        )
