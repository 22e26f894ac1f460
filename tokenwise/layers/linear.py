"""Linear layers whose weights can be filled piece by piece from a Hugging Face checkpoint.

Checkpoints store q/k/v and gate/up as separate matrices, but one matmul over a fused weight is
faster than three (or two) small ones. The fused layers keep one weight and give each
checkpoint tensor a row range ("shard") to be copied into; `weight_loader` does that copy, so the
model's `load_weights` only has to say *which* shard a checkpoint tensor is.

Parameters are created with `torch.empty` so that they land in whatever default dtype and
device the loader set up: no fp32 copy is ever materialised for a bf16 model. The checked copy
itself (`copy_checked`, `default_weight_loader`) lives in `weight_utils`, shared with the models.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tokenwise.layers.weight_utils import copy_checked, default_weight_loader


class ReplicatedLinear(nn.Module):
    """`y = x W^T + b`, state-dict compatible with `nn.Linear` (used for o_proj / down_proj)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        default_weight_loader(param, loaded_weight, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"


class MergedLinear(ReplicatedLinear):
    """Several linears over the same input stacked along the output rows (e.g. gate_up_proj).

    Shard ids are the positions in `output_sizes`: for gate_up, 0 is gate and 1 is up.
    """

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = False) -> None:
        super().__init__(input_size, sum(output_sizes), bias)
        self.output_sizes = list(output_sizes)

    def shard_rows(self, shard_id: int) -> tuple[int, int]:
        """(offset, size) of one shard's rows in the fused weight."""
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(
                f"shard id must be an int in [0, {len(self.output_sizes)}), got {shard_id!r}"
            )
        return sum(self.output_sizes[:shard_id]), self.output_sizes[shard_id]

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        if shard_id is None:  # an already-fused checkpoint tensor
            copy_checked(param, loaded_weight)
            return
        offset, size = self.shard_rows(shard_id)  # type: ignore[arg-type]
        copy_checked(param.data.narrow(0, offset, size), loaded_weight)


class QKVLinear(MergedLinear):
    """The q, k and v projections as one matmul; with GQA k and v have fewer rows than q.

    Output columns are `[q (num_heads*head_dim) | k (num_kv_heads*head_dim) | v (same)]`, which
    is what `split(self.output_sizes, dim=-1)` undoes in the attention module.
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
        q_size = num_heads * head_dim
        kv_size = num_kv_heads * head_dim
        super().__init__(hidden_size, [q_size, kv_size, kv_size], bias)
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        if shard_id is not None and shard_id not in self._SHARDS:
            raise ValueError(f"QKV shard id must be 'q', 'k' or 'v', got {shard_id!r}")
        index = None if shard_id is None else self._SHARDS[shard_id]  # type: ignore[index]
        super().weight_loader(param, loaded_weight, index)
