"""A step's attention metadata: one object per attention spec, over the step's buffers.

A mixin of `ModelRunner` and the runners built on it (pipeline stages, pooling and
encoder-decoder kinds), kept apart as a concept of its own: a spec is a sliding window (or
none); layers sharing one get the same metadata object, built once per step by the spec's
`CommonMetadataBuilder` (SPEC §3's `prepare()` then `build(...)`) from the window-trimmed block
tables. It reads the runner's `_builders` (spec -> builder), `_spec_of` (layer -> spec),
`_verify_as_decode` and `input_batch`.
"""

from __future__ import annotations

from tokenwise.attention.metadata import AttentionMetadata, CommonMetadataBuilder
from tokenwise.distributed.tp_channel import SpecTables
from tokenwise.runner.input_batch import InputBatch, StepInputs
from tokenwise.runner.verify_rows import as_decode_rows, is_verify_step


class StepMetadataMixin:
    _builders: dict[int | None, CommonMetadataBuilder]
    _spec_of: dict[str, int | None]
    _verify_as_decode: bool
    input_batch: InputBatch

    def _metadata_tables(self, step: StepInputs) -> SpecTables:
        """Each attention spec's block tables (window-trimmed where the spec slides)."""
        tables: SpecTables = {}
        for spec in self._builders:
            if spec is None:
                tables[spec] = (step.block_tables, None)
            else:
                tables[spec] = self.input_batch.windowed_block_tables(step, spec)
        return tables

    def _attn_metadata(
        self, step: StepInputs, tables: SpecTables, cuda_graph_pad_size: int = -1
    ) -> dict[str, AttentionMetadata]:
        """One metadata object per attention spec over the step's buffers, keyed by layer.

        Each spec's `CommonMetadataBuilder` makes it (SPEC §3's `prepare()` then `build(...)`),
        over the step's device buffers. `cuda_graph_pad_size` (the padding rows of a step a
        FULL graph replays) marks graph metadata; PIECEWISE steps run attention eagerly, so
        their padded metadata is plain.
        """
        if cuda_graph_pad_size == -1 and self._verify_as_decode and is_verify_step(step):
            step, tables = as_decode_rows(step, tables)
        seq_lens = step.context_lens_np + step.query_lens_np
        batch_size = step.num_reqs if cuda_graph_pad_size != -1 else -1
        metadata_by_spec = {}
        for spec, builder in self._builders.items():
            builder.prepare()
            metadata_by_spec[spec] = builder.build(
                seq_lens,
                step.query_lens_np,
                cuda_graph_pad_size,
                batch_size,
                slot_mapping=step.slot_mapping,
                seq_lens_tensor=step.seq_lens,
                block_tables=tables[spec][0],
                block_table_first_block=tables[spec][1],
            )
        return {name: metadata_by_spec[spec] for name, spec in self._spec_of.items()}
