"""The one typed message a step sends to the other processes of a model: TP workers and
pipeline stages.

A worker has no scheduler and no requests: it needs the step's flat inputs (token ids,
positions, lengths, each KV-cache group's block tables and slot mapping) to build the same
attention metadata as the driver and run the same forward pass, which rows sample (it joins
the LM head's gather for them), and the step's LoRA adapters. `StepMessage` says exactly that,
as a msgspec struct: host tensors travel as (dtype, shape, raw bytes), so nothing but these
types is ever decoded on the other side (no pickle of arbitrary objects between processes),
and the bytes own their data (the driver's buffers may be overwritten by the next step while
a pipeline stage still holds this one).
"""

from __future__ import annotations

import msgspec
import numpy as np
import torch

from tokenwise.lora.request import LoRARequest
from tokenwise.runner.input_batch import StepInputs

# KV-cache group -> (its block tables, the first logical block of each row (None: all 0, an
# untrimmed table), its slot mapping). Each group keeps the step's tokens in blocks of its own.
GroupTables = dict[int, tuple[torch.Tensor, list[int] | None, torch.Tensor]]


class Array(msgspec.Struct, array_like=True, frozen=True):
    """A host tensor on the wire."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    @classmethod
    def of(cls, value: torch.Tensor | np.ndarray) -> Array:
        array = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else value
        array = np.ascontiguousarray(array)
        return cls(array.dtype.str, tuple(array.shape), array.tobytes())

    def numpy(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype=np.dtype(self.dtype)).reshape(self.shape)

    def tensor(self, device: torch.device) -> torch.Tensor:
        host = torch.from_numpy(self.numpy().copy())  # writable, owned
        return host if device.type == "cpu" else host.to(device, non_blocking=True)


class GroupStep(msgspec.Struct, array_like=True, frozen=True):
    """One KV-cache group's part of a step."""

    group: int
    block_tables: Array
    first_block: list[int] | None
    slot_mapping: Array


class StatePlan(msgspec.Struct, array_like=True, frozen=True):
    """A step's recurrent-state work (`runner/recurrent_states.py`), the same on every rank:
    each row's live slot, where its tokens start (`starts`, one more than rows), whether its
    per-token states are kept (a verifying request), and the copies around the forward pass:
    `init` (live slot, source slot or -1 for zeros) before it, `snapshot` (live slot,
    snapshot slot) after it."""

    slots: list[int]
    starts: list[int]
    keep: list[bool]
    init: list[tuple[int, int]]
    snapshot: list[tuple[int, int]]


class CrossStep(msgspec.Struct, array_like=True, frozen=True):
    """An encoder-decoder step's cross-attention rows (`runner/cross_metadata.py`), for the
    later pipeline stages, which have no requests: per decoder sequence its encoder output's
    length and cross block table, and the cross slots of the encoder tokens this step writes
    (none in a step where no encoder runs)."""

    encoder_lens: list[int]
    block_tables: Array
    slot_mapping: Array


class StepMessage(msgspec.Struct, array_like=True, frozen=True):
    """Everything a TP worker or a pipeline stage needs to run the driver's step."""

    num_reqs: int
    input_ids: Array
    positions: Array
    seq_lens: Array
    query_lens: Array
    context_lens: Array
    groups: list[GroupStep]
    logits_indices: list[int]
    loras: list[LoRARequest | None] = []
    states: StatePlan | None = None
    # `[3, T]` M-RoPE positions of a vision-language model (Qwen2.5-VL), for later stages.
    mrope_positions: Array | None = None
    # Per prefill row, the image spans its queries see both ways (Gemma 3), for later stages.
    image_spans: list[list[tuple[int, int]]] | None = None
    # An encoder-decoder model's cross-attention rows (BART, Whisper), for later stages.
    cross: CrossStep | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(StepMessage)


def encode_step(
    step: StepInputs,
    tables: GroupTables,
    loras: list | None = None,
    states: StatePlan | None = None,
    mrope_positions: torch.Tensor | None = None,
    image_spans: list[list[tuple[int, int]]] | None = None,
    cross: CrossStep | None = None,
) -> bytes:
    """The step as bytes (`decode_step` reads them back)."""
    message = StepMessage(
        num_reqs=step.num_reqs,
        input_ids=Array.of(step.input_ids),
        positions=Array.of(step.positions),
        seq_lens=Array.of(step.seq_lens),
        query_lens=Array.of(step.query_lens_np),
        context_lens=Array.of(step.context_lens_np),
        groups=[
            GroupStep(g, Array.of(table), first, Array.of(slots))
            for g, (table, first, slots) in tables.items()
        ],
        logits_indices=list(step.logits_indices),
        loras=list(loras or []),
        states=states,
        mrope_positions=None if mrope_positions is None else Array.of(mrope_positions),
        image_spans=image_spans,
        cross=cross,
    )
    return _ENCODER.encode(message)


def decode_step(data: bytes) -> StepMessage:
    """A step message; a malformed one raises `msgspec.ValidationError` naming the field."""
    return _DECODER.decode(data)


def step_inputs(message: StepMessage, device: torch.device) -> tuple[StepInputs, GroupTables]:
    """The worker's copy of the step: its inputs on `device` and each group's tables."""
    tables: GroupTables = {
        g.group: (g.block_tables.tensor(device), g.first_block, g.slot_mapping.tensor(device))
        for g in message.groups
    }
    step = StepInputs(
        num_reqs=message.num_reqs,
        num_tokens=message.num_tokens,
        input_ids=message.input_ids.tensor(device),
        positions=message.positions.tensor(device),
        slot_mapping=tables[0][2],
        seq_lens=message.seq_lens.tensor(device),
        block_tables=tables[0][0],
        rows=np.zeros(0, dtype=np.int64),
        query_lens_np=message.query_lens.numpy().copy(),
        context_lens_np=message.context_lens.numpy().copy(),
        logits_indices=list(message.logits_indices),
        sampled=[],
    )
    return step, tables


__all__ = [
    "Array",
    "CrossStep",
    "GroupStep",
    "GroupTables",
    "StatePlan",
    "StepMessage",
    "decode_step",
    "encode_step",
    "step_inputs",
]
