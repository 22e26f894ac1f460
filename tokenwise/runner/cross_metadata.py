"""Cross-attention metadata of an encoder-decoder step (BART, Whisper), the same on every
pipeline stage.

Cross-attention layers read the decoder's metadata plus, per decoder sequence, the length of
its encoder output and its cross block table, and the cross slots of the encoder tokens this
step writes (`with_cross_fields`). Only the driver can compute those: it has the requests and
their cross blocks (`engine/kinds/encoder_decoder_runner.py`). A later pipeline stage has
neither, so the driver puts them in the step message (`cross_step`, a `CrossStep`) and the
stage lays them over its own decoder metadata for its own cross-attention layers
(`apply_cross_step`), which then write and read their K/V exactly where the driver's do.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from tokenwise.attention.metadata import AttentionMetadata
from tokenwise.attention.utils import AttentionType
from tokenwise.distributed.step_message import Array, CrossStep


def with_cross_fields(
    decoder_md: AttentionMetadata,
    encoder_lens: list[int],
    cross_block_tables: torch.Tensor,
    cross_slot_mapping: torch.Tensor,
) -> AttentionMetadata:
    """A copy of the decoder's metadata that cross-attention reads: `encoder_lens[i]` and row
    `i` of `cross_block_tables` are sequence i's, `cross_slot_mapping` the slots of this step's
    encoder tokens (all on the metadata's device)."""
    device = cross_block_tables.device
    return dataclasses.replace(
        decoder_md,
        num_encoder_tokens=int(cross_slot_mapping.shape[0]),
        encoder_seq_lens=list(encoder_lens),
        encoder_seq_lens_tensor=torch.tensor(encoder_lens, dtype=torch.int32, device=device),
        max_encoder_seq_len=max(encoder_lens, default=0),
        cross_slot_mapping=cross_slot_mapping,
        cross_block_tables=cross_block_tables,
    )


def cross_step(metadata: dict[str, AttentionMetadata]) -> CrossStep | None:
    """The driver's cross rows for the step message; None for a model without
    cross-attention."""
    md = next((m for m in metadata.values() if m.cross_block_tables is not None), None)
    if md is None:
        return None
    assert md.encoder_seq_lens is not None and md.cross_slot_mapping is not None
    return CrossStep(
        list(md.encoder_seq_lens), Array.of(md.cross_block_tables), Array.of(md.cross_slot_mapping)
    )


def apply_cross_step(
    cross: CrossStep,
    metadata: dict[str, AttentionMetadata],
    layers: dict[str, Any],
    device: torch.device,
) -> None:
    """A later stage: its cross-attention layers (of `layers`, by name) read the driver's
    cross rows over the decoder metadata they were given."""
    names = [
        name
        for name, layer in layers.items()
        if getattr(layer, "attn_type", None) is AttentionType.ENCODER_DECODER
    ]
    if not names:
        return
    md = with_cross_fields(
        metadata[names[0]],
        cross.encoder_lens,
        cross.block_tables.tensor(device),
        cross.slot_mapping.tensor(device),
    )
    for name in names:
        metadata[name] = md
