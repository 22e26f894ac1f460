"""Adapter slots inside one linear layer, and the per-token adapter mask they all read.

Every targeted linear layer gets a `LoRASlots`: the A and B matrices of all `max_loras` slots,
stacked, allocated once at start-up. A step mixing several adapters and the base model then costs
two extra matmuls per layer, whatever the mix:

    xa  = x @ A_all^T                    [tokens, max_loras * R]   (shrink, every slot at once)
    xa *= mask[token, slot]              zero every slot but the token's own (base: all zero)
    out += xa @ B_all^T                  [tokens, out]             (expand)

`R` is `max_lora_rank` times the number of parts of a fused layer (q/k/v: 3, gate/up: 2): each
part has its own A rows, and B is block-diagonal, so part p's rows read only part p's columns.
The scale `alpha / r` is folded into B when an adapter is loaded. The extra work is
`max_loras * R / out` of the layer's own matmul (a few percent for ranks of 8-64), it needs no
host read and no per-adapter loop, so it is the same graph for every batch.

Under tensor parallelism the slots are sharded like the layer: a column-parallel layer keeps
every A whole and this rank's rows of B; a row-parallel layer this rank's input columns of A and
B whole, and its partial sums ride the layer's own all-reduce (the maths is linear), so LoRA
adds no collective.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LoRAState:
    """The step's token-to-slot mask `[tokens, max_loras]` (1 where a token uses that slot).

    One persistent buffer shared by every `LoRASlots`; the runner rewrites its first rows each
    step, and the rows past the step stay zero (graph padding runs as base-model tokens).
    """

    def __init__(
        self, max_num_tokens: int, max_loras: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.max_loras = max_loras
        # False for a step of base-model tokens only: the layers then skip their LoRA matmuls
        # (and base-model graphs are captured without them; see CUDAGraphRunner).
        self.active = False
        self.token_mask = torch.zeros(max_num_tokens, max_loras, dtype=dtype, device=device)
        self._num_rows = 0

    def set_token_slots(self, token_slots: torch.Tensor) -> None:
        """`token_slots[t]` is token t's slot, -1 for the base model."""
        rows = max(self._num_rows, token_slots.numel())
        self.token_mask[:rows].zero_()
        used = token_slots >= 0
        if bool(used.any()):
            tokens = torch.nonzero(used).flatten().to(self.token_mask.device)
            self.token_mask[tokens, token_slots[used].to(self.token_mask.device)] = 1
        self._num_rows = token_slots.numel()
        self.active = bool(used.any())


class LoRASlots(nn.Module):
    """All slots' A/B of one linear layer (its local shard under TP); see the module doc."""

    def __init__(
        self,
        state: LoRAState,
        input_size: int,
        output_sizes: list[int],
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.state = state
        self.num_parts = len(output_sizes)
        self.output_sizes = output_sizes
        self.max_rank = max_rank
        self.slot_width = self.num_parts * max_rank
        width = state.max_loras * self.slot_width
        kwargs = {"dtype": dtype, "device": device}
        self.register_buffer("lora_a", torch.zeros(width, input_size, **kwargs), persistent=False)
        self.register_buffer(
            "lora_b", torch.zeros(sum(output_sizes), width, **kwargs), persistent=False
        )

    def forward(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` (the layer's own output for `x`) plus every token's adapter delta."""
        if not self.state.active:
            return out
        num_tokens = x.shape[0]
        xa = F.linear(x, self.lora_a).view(num_tokens, self.state.max_loras, self.slot_width)
        xa = xa * self.state.token_mask[:num_tokens, :, None]
        return out + F.linear(xa.flatten(1), self.lora_b)

    def clear_slot(self, slot: int) -> None:
        cols = slice(slot * self.slot_width, (slot + 1) * self.slot_width)
        self.lora_a[cols].zero_()
        self.lora_b[:, cols].zero_()

    def set_part(
        self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor, row_offset: int
    ) -> None:
        """Put one part's local `a [r, in]` and scaled `b [rows, r]` into `slot`."""
        rank = a.shape[0]
        start = slot * self.slot_width + part * self.max_rank
        self.lora_a[start : start + rank].copy_(a)
        rows = slice(row_offset, row_offset + b.shape[0])
        self.lora_b[rows, start : start + rank].copy_(b)

    def extra_repr(self) -> str:
        return f"slots={self.state.max_loras}, max_rank={self.max_rank}, parts={self.output_sizes}"
