"""A step's attention metadata: one object per KV-cache group (and window), over the step's
buffers.

A part the runner holds (`runner.step_metadata`; pipeline stages, pooling and encoder-decoder
kinds use the same one), a concept of its own: layers of one KV-cache group
(`tokenwise.kv_cache.layout`) share block tables and a slot mapping, so they get the same
metadata object, built once per step by the group's `CommonMetadataBuilder`
(docs/forward-context.md §3: `prepare()` then `build(...)`); sliding-window groups read
window-trimmed tables. Layers with no
table of their own (encoder-only attention, and cross-attention, which adds its fields to the
decoder's metadata) read group 0's.
"""

from __future__ import annotations

from typing import Any

import torch

from tokenwise.attention.layer import Attention, AttentionLayerBase
from tokenwise.attention.metadata import AttentionMetadata, CommonMetadataBuilder
from tokenwise.attention.utils import AttentionType
from tokenwise.config import EngineConfig
from tokenwise.distributed.pp_state import get_pp_size
from tokenwise.distributed.step_message import GroupTables
from tokenwise.kv_cache.layout import KVCacheLayout
from tokenwise.kv_cache.specs import CrossAttentionSpec
from tokenwise.runner.input_batch import InputBatch, StepInputs
from tokenwise.runner.verify_rows import as_decode_rows, graph_verify_len, is_verify_step


def metadata_groups(
    layout: KVCacheLayout, layers: dict[str, Any], block_size: int, device: torch.device
) -> tuple[dict[int, tuple[int, CommonMetadataBuilder]], dict[str, int]]:
    """The step's metadata objects: one per (KV-cache group, sliding window) pair, as
    index -> (its group, its builder), and the index each attention layer reads.

    In a hybrid layout a group has one window; in one where sliding layers keep every block
    (pipeline parallelism, `make_layout(..., hybrid=False)`) a group holds layers of several
    windows, which all read its untrimmed tables and mask by their own window. Layers with no
    table of their own (encoder-only, cross-attention) read group 0's plain metadata.
    """
    keys: dict[tuple[int, int | None], int] = {}
    index_of: dict[str, int] = {}
    # Pipeline stages read the driver's tables by index, but each stage holds other layers:
    # there every group's object is its untrimmed tables at index = group (sliding layers mask
    # by their own window), the same on every stage.
    staged = get_pp_size() > 1
    if staged:
        keys = {(g, None): g for g in range(layout.num_attention_groups)}
    for name, layer in layers.items():
        group = layout.find_group(name)
        if (
            group is None
            or layout.groups[group].spec.pool != "kv"
            or isinstance(layout.groups[group].spec, CrossAttentionSpec)
        ):
            group, window = 0, None
        else:
            window = None if staged else getattr(layer, "sliding_window", None)
        index_of[name] = keys.setdefault((group, window), len(keys))
    keys = keys or {(0, None): 0}
    builders = {i: (g, CommonMetadataBuilder(block_size, w, device)) for (g, w), i in keys.items()}
    return builders, index_of


class StepMetadata:
    """The builders of one runner's metadata objects and which object each layer reads.

    `verify_as_decode`: speculative verification rows attend as decode rows
    (`verify_rows.py`), where the one-call CPU decode kernel takes them.
    """

    def __init__(
        self,
        layout: KVCacheLayout,
        layers: dict[str, Any],
        block_size: int,
        device: torch.device,
        verify_as_decode: bool,
    ) -> None:
        self.builders, self.index_of = metadata_groups(layout, layers, block_size, device)
        self.verify_as_decode = verify_as_decode

    def tables(self, batch: InputBatch, step: StepInputs) -> GroupTables:
        """Each group's block tables (window-trimmed where it slides) and slot mapping."""
        tables: GroupTables = {}
        slots = step.group_slot_mappings or (step.slot_mapping,)
        for index, (group, builder) in self.builders.items():
            window = builder.sliding_window
            if window is None:
                table = batch.group_block_tables(step, group)
                tables[index] = (table, None, slots[group])
            else:
                table, first = batch.windowed_block_tables(step, window, group)
                tables[index] = (table, first, slots[group])
        return tables

    def build(
        self, step: StepInputs, tables: GroupTables, cuda_graph_pad_size: int = -1
    ) -> dict[str, AttentionMetadata]:
        """One metadata object per KV-cache group over the step's buffers, keyed by layer.

        Each group's `CommonMetadataBuilder` makes it (docs/forward-context.md §3: `prepare()` then
        `build(...)`), over the step's device buffers. `cuda_graph_pad_size` (the padding rows
        of a step a FULL graph replays) marks graph metadata; PIECEWISE steps run attention
        eagerly, so their padded metadata is plain.
        """
        if cuda_graph_pad_size == -1 and self.verify_as_decode and is_verify_step(step):
            step, tables = as_decode_rows(step, tables)
        seq_lens = step.context_lens_np + step.query_lens_np
        batch_size = step.num_reqs if cuda_graph_pad_size != -1 else -1
        metadata_by_group = {}
        for index, (_, builder) in self.builders.items():
            table, first, slots = tables[index]
            builder.prepare()
            metadata_by_group[index] = builder.build(
                seq_lens,
                step.query_lens_np,
                cuda_graph_pad_size,
                batch_size,
                slot_mapping=slots,
                seq_lens_tensor=step.seq_lens,
                block_tables=table,
                block_table_first_block=first,
            )
        return {name: metadata_by_group[g] for name, g in self.index_of.items()}


def make_step_metadata(
    config: EngineConfig,
    layout: KVCacheLayout,
    attn_layers: dict[str, AttentionLayerBase],
    device: torch.device,
) -> tuple[StepMetadata, int | None]:
    """The runner's `StepMetadata`, and the query length of the verification batches that
    replay FULL graphs over decode rows (None: none do; `verify_rows.graph_verify_len`).

    Verification steps may attend as decode rows only over plain causal decoder attention,
    and on CPU only, where the one-call decode kernel takes them; uniform verification batches
    replay FULL graphs over the same decode rows on any device.
    """
    plain_decoder = all(
        type(layer) is Attention and layer.attn_type is AttentionType.DECODER
        for layer in attn_layers.values()
    )
    metadata = StepMetadata(
        layout,
        attn_layers,
        config.cache.block_size,
        device,
        verify_as_decode=device.type == "cpu" and plain_decoder,
    )
    return metadata, graph_verify_len(config.speculative, plain_decoder)
