"""A step's attention metadata: one object per KV-cache group, over the step's buffers.

A mixin of `ModelRunner` and the runners built on it (pipeline stages, pooling and
encoder-decoder kinds), kept apart as a concept of its own: layers of one KV-cache group
(`tokenwise.kv_cache.layout`) share block tables and a slot mapping, so they get the same
metadata object, built once per step by the group's `CommonMetadataBuilder` (SPEC §3's
`prepare()` then `build(...)`); sliding-window groups read window-trimmed tables. Layers with no
table of their own (encoder-only attention, and cross-attention, which adds its fields to the
decoder's metadata) read group 0's. It reads the runner's `_builders` (self-attention group ->
builder), `_metadata_group_of` (layer -> group), `_verify_as_decode` and `input_batch`.
"""

from __future__ import annotations

import torch

from tokenwise.attention.metadata import AttentionMetadata, CommonMetadataBuilder
from tokenwise.distributed.step_message import GroupTables
from tokenwise.kv_cache.layout import KVCacheLayout
from tokenwise.kv_cache.specs import CrossAttentionSpec, SlidingWindowSpec
from tokenwise.runner.input_batch import InputBatch, StepInputs
from tokenwise.runner.verify_rows import as_decode_rows, is_verify_step


def metadata_groups(
    layout: KVCacheLayout, layer_names: list[str], block_size: int, device: torch.device
) -> tuple[dict[int, CommonMetadataBuilder], dict[str, int]]:
    """A builder per self-attention group (one, over group 0, for a model with none) and the
    group whose metadata each attention layer reads."""
    builders = {
        g: CommonMetadataBuilder(
            block_size,
            group.spec.sliding_window if isinstance(group.spec, SlidingWindowSpec) else None,
            device,
        )
        for g, group in enumerate(layout.groups)
        if not isinstance(group.spec, CrossAttentionSpec) and group.spec.pool == "kv"
    }
    builders = builders or {0: CommonMetadataBuilder(block_size, None, device)}
    group_of = {}
    for name in layer_names:
        own = layout.find_group(name)
        group_of[name] = own if own in builders else 0
    return builders, group_of


class StepMetadataMixin:
    _builders: dict[int, CommonMetadataBuilder]
    _metadata_group_of: dict[str, int]
    _verify_as_decode: bool
    input_batch: InputBatch

    def _metadata_tables(self, step: StepInputs) -> GroupTables:
        """Each group's block tables (window-trimmed where it slides) and slot mapping."""
        tables: GroupTables = {}
        slots = step.group_slot_mappings or (step.slot_mapping,)
        for group, builder in self._builders.items():
            window = builder.sliding_window
            if window is None:
                table = self.input_batch.group_block_tables(step, group)
                tables[group] = (table, None, slots[group])
            else:
                table, first = self.input_batch.windowed_block_tables(step, window, group)
                tables[group] = (table, first, slots[group])
        return tables

    def _attn_metadata(
        self, step: StepInputs, tables: GroupTables, cuda_graph_pad_size: int = -1
    ) -> dict[str, AttentionMetadata]:
        """One metadata object per KV-cache group over the step's buffers, keyed by layer.

        Each group's `CommonMetadataBuilder` makes it (SPEC §3's `prepare()` then
        `build(...)`), over the step's device buffers. `cuda_graph_pad_size` (the padding rows
        of a step a FULL graph replays) marks graph metadata; PIECEWISE steps run attention
        eagerly, so their padded metadata is plain.
        """
        if cuda_graph_pad_size == -1 and self._verify_as_decode and is_verify_step(step):
            step, tables = as_decode_rows(step, tables)
        seq_lens = step.context_lens_np + step.query_lens_np
        batch_size = step.num_reqs if cuda_graph_pad_size != -1 else -1
        metadata_by_group = {}
        for group, builder in self._builders.items():
            table, first, slots = tables[group]
            builder.prepare()
            metadata_by_group[group] = builder.build(
                seq_lens,
                step.query_lens_np,
                cuda_graph_pad_size,
                batch_size,
                slot_mapping=slots,
                seq_lens_tensor=step.seq_lens,
                block_tables=table,
                block_table_first_block=first,
            )
        return {name: metadata_by_group[g] for name, g in self._metadata_group_of.items()}
