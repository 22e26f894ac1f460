"""Persistent attention buffers for CUDA-graph capture and replay.

A captured graph reads fixed addresses, so the metadata tensors a graph uses (slot mapping,
sequence lengths, block tables) must live in buffers allocated once; before each replay the real
batch is copied into them. Padding rows hold PAD slots and length-1 sequences so that they never
write or read a real KV block. Nothing here needs a GPU: capture itself happens in the runner.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from tokenwise.attention.attn_metadata import AttentionMetadata
from tokenwise.attention.utils import PAD_SLOT_ID, is_all_cross_attn_metadata_set


class CommonAttentionState:
    """Owns the graph input buffers for one attention spec."""

    def __init__(
        self,
        max_batch_size: int,
        max_blocks_per_seq: int,
        block_size: int,
        device: Any = "cpu",
        max_cross_blocks_per_seq: int = 0,
    ) -> None:
        self.max_batch_size = max_batch_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_size = block_size
        self.device = torch.device(device)
        # Encoder-decoder models: the widest cross block table (the longest encoder's blocks).
        self.max_cross_blocks_per_seq = max_cross_blocks_per_seq
        self._graph_encoder_seq_lens: torch.Tensor | None = None
        self._graph_cross_block_tables: torch.Tensor | None = None
        # Host staging for those two (lengths, tables), made on the first write.
        self._host_cross: tuple[torch.Tensor, torch.Tensor] | None = None
        # Host staging buffer for block tables: written row by row, copied to device once.
        self.graph_block_tables = torch.zeros(
            (max_batch_size, max_blocks_per_seq), dtype=torch.int32
        )
        self._is_graph_capturing = False
        self._graph_slot_mapping: torch.Tensor | None = None
        self._graph_seq_lens: torch.Tensor | None = None
        self._graph_block_tables: torch.Tensor | None = None
        self._bound: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def bind_buffers(
        self, slot_mapping: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor
    ) -> None:
        """Capture on these persistent buffers instead of allocating new ones.

        The engine binds its input batch's device buffers, into which every step's inputs are
        already written: a replayed graph then reads them where they are, with no copy into
        buffers of its own (`prepare_graph_input_buffers` is for unbound states).
        """
        if block_tables.shape[1] != self.max_blocks_per_seq:
            raise ValueError(
                f"bound block tables have {block_tables.shape[1]} columns, the state "
                f"{self.max_blocks_per_seq}"
            )
        if min(slot_mapping.shape[0], seq_lens.shape[0], block_tables.shape[0]) < (
            self.max_batch_size
        ):
            raise ValueError(f"bound buffers hold fewer than {self.max_batch_size} rows")
        self._bound = (slot_mapping, seq_lens, block_tables)

    @contextmanager
    def graph_capture(
        self, max_batch_size: int, is_encoder_decoder_model: bool = False
    ) -> Iterator[None]:
        """Allocate the device buffers for the duration of capture (and replay afterwards).

        An encoder-decoder model's decode steps also read each sequence's encoder length and
        cross block table: those get buffers too (padding rows: length 1, block 0). A decode
        step writes no cross K/V (encoders run only in the step that admits a request, which
        has a prefill or runs eagerly), so the cross slot mapping is always empty.
        """
        if max_batch_size > self.max_batch_size:
            raise ValueError(
                f"graph capture batch size {max_batch_size} exceeds max_batch_size "
                f"{self.max_batch_size}"
            )
        self._is_graph_capturing = True
        if self._bound is not None:
            slots, lens, tables = self._bound
            with torch.inference_mode():  # the engine's buffers are inference tensors
                self._graph_slot_mapping = slots[:max_batch_size].fill_(PAD_SLOT_ID)
                self._graph_seq_lens = lens[:max_batch_size].fill_(1)
                self._graph_block_tables = tables[:max_batch_size].zero_()
        else:
            self._graph_slot_mapping = torch.full(
                (max_batch_size,), PAD_SLOT_ID, dtype=torch.int64, device=self.device
            )
            self._graph_seq_lens = torch.ones(max_batch_size, dtype=torch.int32, device=self.device)
            self._graph_block_tables = self.graph_block_tables[:max_batch_size].to(self.device)
        if is_encoder_decoder_model:
            if self.max_cross_blocks_per_seq < 1:
                raise ValueError("an encoder-decoder state needs max_cross_blocks_per_seq >= 1")
            self._graph_encoder_seq_lens = torch.ones(
                max_batch_size, dtype=torch.int32, device=self.device
            )
            self._graph_cross_block_tables = torch.zeros(
                (max_batch_size, self.max_cross_blocks_per_seq),
                dtype=torch.int32,
                device=self.device,
            )
        try:
            yield
        finally:
            self._is_graph_capturing = False

    def graph_clone(self, batch_size: int) -> CommonAttentionState:
        """A state with fresh buffers of the same shape (for capturing another graph family)."""
        if not self._is_graph_capturing:
            raise RuntimeError("graph_clone() is only valid inside graph_capture()")
        return CommonAttentionState(
            batch_size, self.max_blocks_per_seq, self.block_size, self.device
        )

    def graph_capture_get_metadata_for_batch(
        self, batch_size: int, is_encoder_decoder_model: bool = False
    ) -> AttentionMetadata:
        """Metadata for capturing a decode batch of `batch_size` padding-only rows."""
        if self._graph_slot_mapping is None or not self._is_graph_capturing:
            raise RuntimeError("call graph_capture_get_metadata_for_batch inside graph_capture()")
        assert self._graph_seq_lens is not None and self._graph_block_tables is not None
        capacity = self._graph_slot_mapping.shape[0]
        if batch_size > capacity:
            raise ValueError(
                f"batch size {batch_size} exceeds the {capacity} rows allocated by graph_capture()"
            )
        md = AttentionMetadata.for_sequences(
            [1] * batch_size,
            [0] * batch_size,
            self._graph_slot_mapping[:batch_size],
            self._graph_block_tables[:batch_size],
            seq_lens_tensor=self._graph_seq_lens[:batch_size],
            block_size=self.block_size,
            use_cuda_graph=True,
            host_seq_lens=False,
            max_decode_seq_len=self.max_blocks_per_seq * self.block_size,
        )
        if is_encoder_decoder_model:
            if self._graph_encoder_seq_lens is None or self._graph_cross_block_tables is None:
                raise RuntimeError("graph_capture() was entered without is_encoder_decoder_model")
            md.num_encoder_tokens = 0
            # Host lengths are only read by prefills, which a graph never runs.
            md.encoder_seq_lens = [1] * batch_size
            md.encoder_seq_lens_tensor = self._graph_encoder_seq_lens[:batch_size]
            md.max_encoder_seq_len = self.max_cross_blocks_per_seq * self.block_size
            md.cross_slot_mapping = torch.empty(0, dtype=torch.int64, device=self.device)
            md.cross_block_tables = self._graph_cross_block_tables[:batch_size]
        return md

    def get_graph_input_buffers(
        self, attn_metadata: AttentionMetadata, is_encoder_decoder_model: bool = False
    ) -> dict[str, torch.Tensor]:
        """The tensors a captured graph reads, keyed by name."""
        decode = attn_metadata.decode_metadata
        if decode is None:
            raise ValueError("graph input buffers exist only for decode batches")
        assert decode.seq_lens_tensor is not None
        buffers = {
            "slot_mapping": attn_metadata.slot_mapping,
            "seq_lens_tensor": decode.seq_lens_tensor,
            "block_tables": decode.block_tables,
        }
        if is_encoder_decoder_model:
            if not is_all_cross_attn_metadata_set(attn_metadata):
                raise ValueError("encoder-decoder graph metadata lacks its encoder/cross fields")
            assert attn_metadata.encoder_seq_lens_tensor is not None
            assert attn_metadata.cross_block_tables is not None
            buffers["encoder_seq_lens_tensor"] = attn_metadata.encoder_seq_lens_tensor
            buffers["cross_block_tables"] = attn_metadata.cross_block_tables
        return buffers

    def prepare_graph_input_buffers(
        self,
        input_buffers: dict[str, torch.Tensor],
        attn_metadata: AttentionMetadata,
        is_encoder_decoder_model: bool = False,
    ) -> None:
        """Copy the real batch into the captured buffers before replay (padding rows stay)."""
        decode = attn_metadata.decode_metadata
        if decode is None or decode.seq_lens_tensor is None:
            raise ValueError("only decode batches replay a full graph")
        n = decode.seq_lens_tensor.shape[0]
        input_buffers["slot_mapping"][: attn_metadata.slot_mapping.shape[0]].copy_(
            attn_metadata.slot_mapping, non_blocking=True
        )
        input_buffers["seq_lens_tensor"][:n].copy_(decode.seq_lens_tensor, non_blocking=True)
        cols = decode.block_tables.shape[1]
        input_buffers["block_tables"][:n, :cols].copy_(decode.block_tables, non_blocking=True)
        if is_encoder_decoder_model:
            self._prepare_cross_buffers(input_buffers, attn_metadata, n)

    def _prepare_cross_buffers(
        self, input_buffers: dict[str, torch.Tensor], md: AttentionMetadata, n: int
    ) -> None:
        """Encoder lengths and cross tables of a decode-only step into the graph's buffers."""
        if not is_all_cross_attn_metadata_set(md):
            raise ValueError("an encoder-decoder step needs its encoder/cross fields set")
        if md.num_prefills or md.num_encoder_tokens:
            raise ValueError("a step that runs an encoder or a prefill cannot replay a graph")
        assert md.encoder_seq_lens_tensor is not None and md.cross_block_tables is not None
        cols = md.cross_block_tables.shape[1]
        if cols > input_buffers["cross_block_tables"].shape[1]:
            raise ValueError(
                f"cross block tables of {cols} blocks exceed the captured "
                f"{input_buffers['cross_block_tables'].shape[1]}"
            )
        lens = input_buffers["encoder_seq_lens_tensor"]
        lens[:n].copy_(md.encoder_seq_lens_tensor[:n], non_blocking=True)
        tables = input_buffers["cross_block_tables"]
        tables[:n].zero_()
        tables[:n, :cols].copy_(md.cross_block_tables[:n], non_blocking=True)

    def write_cross_buffers(
        self, encoder_seq_lens: list[int], cross_block_tables: list[list[int]], batch_size: int
    ) -> None:
        """A decode step's encoder lengths and cross tables, written in place for a replay.

        The engine's FULL decode graphs read the buffers `graph_capture` allocated for an
        encoder-decoder model; each step writes its real rows there, and the padding rows up to
        `batch_size` get encoder length 1 and block 0 (read harmlessly, output dropped), so
        they never keep a finished request's table. Staged on the host, one copy each.
        """
        lens, tables = self._graph_encoder_seq_lens, self._graph_cross_block_tables
        if lens is None or tables is None:
            raise RuntimeError("no encoder-decoder graph buffers: capture with them first")
        n = len(encoder_seq_lens)
        if n != len(cross_block_tables) or n > batch_size or batch_size > lens.shape[0]:
            raise ValueError(
                f"{n} encoder lengths, {len(cross_block_tables)} cross tables and batch size "
                f"{batch_size} do not fit the {lens.shape[0]} captured rows"
            )
        if self._host_cross is None:
            pin = self.device.type == "cuda"
            self._host_cross = (
                torch.ones(lens.shape, dtype=torch.int32, pin_memory=pin),
                torch.zeros(tables.shape, dtype=torch.int32, pin_memory=pin),
            )
        host_lens, host_tables = self._host_cross
        host_lens[:batch_size] = 1
        host_lens[:n] = torch.tensor(encoder_seq_lens, dtype=torch.int32)
        host_tables[:batch_size] = 0
        for i, table in enumerate(cross_block_tables):
            if len(table) > tables.shape[1]:
                raise ValueError(
                    f"cross block table of {len(table)} blocks exceeds the captured "
                    f"{tables.shape[1]} (max_cross_blocks_per_seq)"
                )
            host_tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
        lens[:batch_size].copy_(host_lens[:batch_size], non_blocking=True)
        tables[:batch_size].copy_(host_tables[:batch_size], non_blocking=True)

    def begin_forward(self, model_input: Any) -> None:
        """Hook before each forward pass; the torch backends need no per-step preparation."""

    def write_block_tables(self, block_tables: list[list[int]], batch_size: int) -> torch.Tensor:
        """Fill the host buffer's first rows with the real tables (padding rows zeroed)."""
        if batch_size > self.max_batch_size:
            raise ValueError(
                f"batch_size {batch_size} exceeds max_batch_size {self.max_batch_size}"
            )
        buf = self.graph_block_tables[:batch_size]
        buf.zero_()
        for i, table in enumerate(block_tables):
            if len(table) > self.max_blocks_per_seq:
                raise ValueError(
                    f"block table of {len(table)} blocks exceeds max_blocks_per_seq "
                    f"{self.max_blocks_per_seq}"
                )
            buf[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
        return buf
