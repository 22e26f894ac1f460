"""Attention metadata for one forward pass, and the builder that makes it once per step.

Sequences are laid out prefills first, then decodes, so that a backend can split the flat token
stream at `num_prefill_tokens` and run each half with the kernel suited to it. A decode is a
sequence with query length 1; a chunk of a prompt (context > 0, query > 1) is a prefill.

All layers that share an attention spec (block size, sliding window) share one metadata object;
the runner builds one per distinct spec per step, with `CommonMetadataBuilder` over its
persistent input buffers (`tokenwise.runner.input_batch`).

`CommonAttentionState` (docs/forward-context.md §3), the persistent buffers for CUDA-graph capture
and replay, lives in `tokenwise.attention.graph_state`, which imports this module: it is not
re-exported here, because that would make the two modules import each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

__all__ = ["AttentionMetadata", "CommonMetadataBuilder"]


@dataclass
class AttentionMetadata:
    """Batch structure as attention needs it. Tensors live on the model's device."""

    num_prefills: int
    num_prefill_tokens: int
    num_decode_tokens: int
    slot_mapping: torch.Tensor  # [num_tokens] int64, PAD_SLOT_ID = do not write
    seq_lens: list[int] | None  # total length of each sequence after this step
    seq_lens_tensor: torch.Tensor | None  # [num_seqs] int32
    max_query_len: int
    max_prefill_seq_len: int
    max_decode_seq_len: int
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32 (rows padded with 0)
    use_cuda_graph: bool = False
    # Beyond the reference fields: host-side copies so CPU backends never read device tensors,
    # and the first block each (possibly window-trimmed) block table row starts at.
    query_lens: list[int] = field(default_factory=list)
    context_lens: list[int] = field(default_factory=list)
    block_table_first_block: list[int] = field(default_factory=list)
    block_size: int = 16
    sliding_window: int | None = None
    # Encoder-decoder models only (None otherwise; `attention.utils` reads them,
    # docs/forward-context.md §3).
    # For encoder self-attention: the encoders that run this step. For cross-attention: one
    # entry per decoder sequence of the step (its encoder's length, its cross block table),
    # and the cache slots of the encoder tokens whose K/V this step writes.
    num_encoder_tokens: int | None = None
    encoder_seq_lens: list[int] | None = None
    encoder_seq_lens_tensor: torch.Tensor | None = None  # [num_seqs] int32
    max_encoder_seq_len: int | None = None
    cross_slot_mapping: torch.Tensor | None = None  # [num_encoder_tokens] int64
    cross_block_tables: torch.Tensor | None = None  # [num_seqs, max_cross_blocks] int32
    # Gemma 3 (None otherwise): for each prefill row, the (start, end) prompt positions of the
    # images its queries reach, whose tokens attend to each other both ways
    # (`backends/image_mask.py`); set by the multimodal runner once per step.
    bidirectional_spans: list[list[tuple[int, int]]] | None = None

    @classmethod
    def for_sequences(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        *,
        num_prefills: int | None = None,
        seq_lens_tensor: torch.Tensor | None = None,
        block_table_first_block: list[int] | None = None,
        block_size: int = 16,
        sliding_window: int | None = None,
        use_cuda_graph: bool = False,
        host_seq_lens: bool = True,
        max_decode_seq_len: int | None = None,
    ) -> AttentionMetadata:
        """The one constructor: counts and maxima derived from the host-side lengths.

        Sequences come prefills first, then decodes; unless `num_prefills` says how many lead,
        a prefill is a sequence whose query is longer than one token. Graph-capture metadata has
        no host sequence lengths (`host_seq_lens=False`: a replay never runs Python) and
        declares the longest decode a graph may see (`max_decode_seq_len`).
        """
        seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
        if num_prefills is None:
            num_prefills = sum(1 for q in query_lens if q > 1)
        num_prefill_tokens = sum(query_lens[:num_prefills])
        if max_decode_seq_len is None:
            max_decode_seq_len = max(seq_lens[num_prefills:], default=0)
        return cls(
            num_prefills=num_prefills,
            num_prefill_tokens=num_prefill_tokens,
            num_decode_tokens=sum(query_lens) - num_prefill_tokens,
            slot_mapping=slot_mapping,
            seq_lens=seq_lens if host_seq_lens else None,
            seq_lens_tensor=seq_lens_tensor,
            max_query_len=max(query_lens, default=0),
            max_prefill_seq_len=max(seq_lens[:num_prefills], default=0),
            max_decode_seq_len=max_decode_seq_len,
            block_tables=block_tables,
            use_cuda_graph=use_cuda_graph,
            query_lens=list(query_lens),
            context_lens=list(context_lens),
            block_table_first_block=block_table_first_block or [0] * len(query_lens),
            block_size=block_size,
            sliding_window=sliding_window,
        )

    # Fields of docs/forward-context.md §3 that no backend reads on the engine's path: derived from
    # the host-side lengths on first access (on the slot mapping's device) instead of built and
    # copied to the device every step.
    @cached_property
    def query_start_loc(self) -> torch.Tensor:
        """[num_seqs + 1] int32: where each sequence's query starts in the flat token stream."""
        return self._cumulative(self.query_lens)

    @cached_property
    def seq_start_loc(self) -> torch.Tensor:
        """[num_seqs + 1] int32: cumulative sequence lengths (context + query)."""
        return self._cumulative(
            [c + q for c, q in zip(self.context_lens, self.query_lens, strict=True)]
        )

    @cached_property
    def context_lens_tensor(self) -> torch.Tensor:
        """[num_seqs] int32: the tokens of each sequence already in the cache."""
        return torch.tensor(self.context_lens, dtype=torch.int32, device=self.slot_mapping.device)

    def _cumulative(self, lengths: list[int]) -> torch.Tensor:
        starts = np.zeros(len(lengths) + 1, dtype=np.int32)
        np.cumsum(lengths, out=starts[1:])
        return torch.from_numpy(starts).to(self.slot_mapping.device)

    @cached_property
    def first_block_tensor(self) -> torch.Tensor:
        """`block_table_first_block` as an int32 tensor, built once per step for all layers."""
        return torch.tensor(self.block_table_first_block, dtype=torch.int32)

    @cached_property
    def total_seq_len(self) -> int:
        """Keys of all sequences together (host lengths; 0 without them), once per step."""
        return sum(self.seq_lens) if self.seq_lens is not None else 0

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_decodes(self) -> int:
        return self.num_seqs - self.num_prefills

    @cached_property
    def prefill_metadata(self) -> AttentionMetadata | None:
        """A view of the prefill sequences only (None when the batch has none)."""
        if self.num_prefills == 0:
            return None
        return self._slice(0, self.num_prefills, 0, self.num_prefill_tokens, decode=False)

    @cached_property
    def decode_metadata(self) -> AttentionMetadata | None:
        """A view of the decode sequences only (None when the batch has none)."""
        if self.num_decode_tokens == 0:
            return None
        n = self.num_prefill_tokens
        return self._slice(self.num_prefills, None, n, n + self.num_decode_tokens, decode=True)

    def _slice(
        self, seq_lo: int, seq_hi: int | None, tok_lo: int, tok_hi: int, decode: bool
    ) -> AttentionMetadata:
        def cut(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[seq_lo:seq_hi]

        sliced = AttentionMetadata.for_sequences(
            self.query_lens[seq_lo:seq_hi],
            self.context_lens[seq_lo:seq_hi],
            self.slot_mapping[tok_lo:tok_hi],
            self.block_tables[seq_lo:seq_hi],
            num_prefills=0 if decode else self.num_prefills,
            seq_lens_tensor=cut(self.seq_lens_tensor),
            block_table_first_block=self.block_table_first_block[seq_lo:seq_hi],
            block_size=self.block_size,
            sliding_window=self.sliding_window,
            use_cuda_graph=self.use_cuda_graph,
            host_seq_lens=self.seq_lens is not None,
            max_decode_seq_len=self.max_decode_seq_len if decode else 0,
        )
        if self.bidirectional_spans is not None and not decode:
            sliced.bidirectional_spans = self.bidirectional_spans[seq_lo:seq_hi]
        return sliced


class CommonMetadataBuilder:
    """Builds a step's `AttentionMetadata` over the runner's persistent input buffers.

    Per step: `prepare()`, then `build(seq_lens, query_lens, cuda_graph_pad_size, batch_size,
    slot_mapping=..., seq_lens_tensor=..., block_tables=...)`. docs/forward-context.md §3 describes
    the seed's list form (one `add_sequence` call per sequence between the two); here the sequences
    are already laid out by `InputBatch.prepare` in its buffers (prefills first, slots computed,
    block table rows zero past each sequence's last block), so `build` receives the step's device
    views of those buffers and the host-side lengths, and uses the tensors as they are: nothing is
    rebuilt from Python lists, nothing is copied.

    Every token's K/V is written to the cache, also under a sliding window: blocks are never
    recycled inside a request and prefix caching shares full blocks, so a cached block must
    hold all of its tokens. Sliding-window specs get window-trimmed tables
    (`InputBatch.windowed_block_tables`) with the first logical block of each row.
    """

    def __init__(
        self, block_size: int, sliding_window: int | None = None, device: torch.device | str = "cpu"
    ) -> None:
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.device = torch.device(device)
        self._prepared = False

    def prepare(self) -> None:
        """Start a step. The buffers carry the step's sequences, so there is nothing to collect
        per sequence; `build` refuses to run without it, so a step never reuses a stale build."""
        self._prepared = True

    def build(
        self,
        seq_lens: Sequence[int] | np.ndarray,
        query_lens: Sequence[int] | np.ndarray,
        cuda_graph_pad_size: int = -1,
        batch_size: int = -1,
        *,
        slot_mapping: torch.Tensor,
        seq_lens_tensor: torch.Tensor,
        block_tables: torch.Tensor,
        block_table_first_block: list[int] | None = None,
    ) -> AttentionMetadata:
        """The step's metadata; the host lengths and the buffers must describe the same rows.

        `seq_lens` and `query_lens` are host-side, one entry per row (context = seq - query).
        `slot_mapping` ([num_tokens] int64), `seq_lens_tensor` ([rows] int32) and
        `block_tables` ([rows, width] int32) are the buffers' device views.

        With a graph (`cuda_graph_pad_size != -1`) the last `cuda_graph_pad_size` rows are the
        padding `InputBatch.pad` already wrote (one token on a PAD slot, length 1, block 0),
        there are `batch_size` rows in all, and the metadata is marked `use_cuda_graph`: its
        tables are untrimmed, as a captured graph's capture metadata has every row start at
        block 0 (a sliding window then applies by masking).
        """
        if not self._prepared:
            raise RuntimeError("CommonMetadataBuilder.build() called without prepare() this step")
        self._prepared = False
        query = np.asarray(query_lens, dtype=np.int64)
        context = np.asarray(seq_lens, dtype=np.int64) - query
        rows = len(query)
        if rows != len(context) or seq_lens_tensor.shape[0] != rows:
            raise ValueError(
                f"{len(context)} seq_lens, {rows} query_lens and a seq_lens_tensor of "
                f"{seq_lens_tensor.shape[0]} rows describe different batches"
            )
        if block_tables.shape[0] != rows or slot_mapping.shape[0] != int(query.sum()):
            raise ValueError(
                f"block tables of {block_tables.shape[0]} rows and {slot_mapping.shape[0]} "
                f"slots do not fit {rows} sequences of {int(query.sum())} query tokens"
            )
        if rows and (query.min() < 1 or context.min() < 0):
            raise ValueError("every sequence needs query_len >= 1 and seq_len >= query_len")
        is_prefill = query > 1
        num_prefills = int(is_prefill.sum())
        if not is_prefill[:num_prefills].all():
            raise ValueError("prefill sequences must come before decode sequences")
        use_graph = cuda_graph_pad_size != -1
        if use_graph:
            self._check_graph_batch(query, context, cuda_graph_pad_size, batch_size)
            if block_table_first_block is not None and any(block_table_first_block):
                raise ValueError("a graph batch needs untrimmed block tables (first block 0)")
        return AttentionMetadata.for_sequences(
            query.tolist(),
            context.tolist(),
            slot_mapping,
            block_tables,
            num_prefills=num_prefills,
            seq_lens_tensor=seq_lens_tensor,
            block_table_first_block=block_table_first_block,
            block_size=self.block_size,
            sliding_window=self.sliding_window,
            use_cuda_graph=use_graph,
        )

    @staticmethod
    def _check_graph_batch(
        query: np.ndarray, context: np.ndarray, pad: int, batch_size: int
    ) -> None:
        """A graph batch: `batch_size` rows, the last `pad` of them padding decodes."""
        if pad < 0 or batch_size != len(query) or pad > batch_size:
            raise ValueError(
                f"cuda_graph_pad_size {pad} and batch_size {batch_size} do not fit a batch of "
                f"{len(query)} rows (the padding must already be in the buffers)"
            )
        if pad and (query[-pad:].max() != 1 or context[-pad:].max() != 0):
            raise ValueError(f"the last {pad} rows are not padding (length-1 decodes)")
