"""`CommonAttentionState`: persistent attention buffers for CUDA-graph capture and replay.

The contract is docs/forward-context.md §3.

A captured graph reads fixed addresses, so the metadata tensors a graph uses (slot mapping,
sequence lengths, block tables) must live in buffers allocated once. The engine binds the input
batch's own device buffers (`bind_buffers`), into which every step is written anyway, so a
decoder's replay copies nothing; an encoder-decoder model's cross rows (encoder lengths, cross
block tables) have buffers of their own here, and `prepare_graph_input_buffers` writes each
replayed step's rows into them. Padding rows hold PAD slots and length-1 sequences so that they
never write or read a real KV block. Nothing here needs a GPU: capture happens in the runner
(`tokenwise.runner.graph_runner`).

Its own module, above `attention.metadata` (it builds capture metadata): `metadata` would
exceed the ~400-line module budget with it, and re-exporting it there would be an import circle.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from tokenwise.attention.metadata import AttentionMetadata
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
        # The block tables a graph reads: this state's own buffer until `bind_buffers` makes it
        # the input batch's.
        self.graph_block_tables = torch.zeros(
            (max_batch_size, max_blocks_per_seq), dtype=torch.int32, device=self.device
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
        buffers of its own (`prepare_graph_input_buffers` skips what already aliases them).
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
        self.graph_block_tables = block_tables

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
            self._graph_block_tables = self.graph_block_tables[:max_batch_size].zero_()
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
        """A state with fresh buffers of the same shape (for capturing another graph family).

        docs/forward-context.md §3 names it; the engine has no use for it: all of a model's graphs
        (FULL and PIECEWISE, every size) share one state bound to the input batch's buffers, so
        nothing captures a second family. Kept minimal, for callers that do.
        """
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
        """The tensors a captured graph reads, keyed by name.

        The graph runner keeps them per captured FULL size and hands them back to
        `prepare_graph_input_buffers` before that size replays.
        """
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
        """Copy the real batch into the captured buffers before replay (padding rows stay).

        A tensor that already is its buffer (the engine's decoder inputs, written in place into
        the bound input-batch buffers) is not copied; an encoder-decoder step's cross rows
        (`is_encoder_decoder_model`) always are, padding rows included.
        """
        decode = attn_metadata.decode_metadata
        if decode is None or decode.seq_lens_tensor is None:
            raise ValueError("only decode batches replay a full graph")
        n = decode.seq_lens_tensor.shape[0]
        _copy_unless_aliased(
            input_buffers["slot_mapping"][: attn_metadata.slot_mapping.shape[0]],
            attn_metadata.slot_mapping,
        )
        _copy_unless_aliased(input_buffers["seq_lens_tensor"][:n], decode.seq_lens_tensor)
        cols = decode.block_tables.shape[1]
        _copy_unless_aliased(input_buffers["block_tables"][:n, :cols], decode.block_tables)
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

    def begin_forward(self, model_input: Any) -> None:
        """Hook before each forward pass: the graph runner calls it once per graph step.

        docs/forward-context.md §3 names it for backends that prepare per-step state outside the
        metadata (e.g. planning a kernel's work split). tokenwise's backends need none, so it does
        nothing; `model_input` is the step's metadata (None for a FULL replay of a decoder).
        """


def _copy_unless_aliased(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.copy_(src)`, skipped when `src` is a view of the same memory (a bound buffer)."""
    if dst.data_ptr() != src.data_ptr() or dst.shape != src.shape:
        dst.copy_(src, non_blocking=True)
