"""`AttentionMetadata`: the batch structure one forward pass hands every attention layer.

Its own module, below both the builder (`attention.metadata`) and the graph buffers
(`attention.graph_state`), which both construct it: neither needs to import the other's module
for it, so there is no import circle between them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch


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
    query_start_loc: torch.Tensor | None  # [num_seqs + 1] int32, cumulative query lengths
    seq_start_loc: torch.Tensor | None  # [num_seqs + 1] int32, cumulative sequence lengths
    context_lens_tensor: torch.Tensor | None  # [num_seqs] int32, tokens already in the cache
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32 (rows padded with 0)
    use_cuda_graph: bool = False
    # Beyond the reference fields: host-side copies so CPU backends never read device tensors,
    # and the first block each (possibly window-trimmed) block table row starts at.
    query_lens: list[int] = field(default_factory=list)
    context_lens: list[int] = field(default_factory=list)
    block_table_first_block: list[int] = field(default_factory=list)
    block_size: int = 16
    sliding_window: int | None = None
    # Encoder-decoder models only (None otherwise; `attention.utils` reads them, SPEC §3).
    # For encoder self-attention: the encoders that run this step. For cross-attention: one
    # entry per decoder sequence of the step (its encoder's length, its cross block table),
    # and the cache slots of the encoder tokens whose K/V this step writes.
    num_encoder_tokens: int | None = None
    encoder_seq_lens: list[int] | None = None
    encoder_seq_lens_tensor: torch.Tensor | None = None  # [num_seqs] int32
    max_encoder_seq_len: int | None = None
    cross_slot_mapping: torch.Tensor | None = None  # [num_encoder_tokens] int64
    cross_block_tables: torch.Tensor | None = None  # [num_seqs, max_cross_blocks] int32

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
        query_start_loc: torch.Tensor | None = None,
        seq_start_loc: torch.Tensor | None = None,
        context_lens_tensor: torch.Tensor | None = None,
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
            query_start_loc=query_start_loc,
            seq_start_loc=seq_start_loc,
            context_lens_tensor=context_lens_tensor,
            block_tables=block_tables,
            use_cuda_graph=use_cuda_graph,
            query_lens=list(query_lens),
            context_lens=list(context_lens),
            block_table_first_block=block_table_first_block or [0] * len(query_lens),
            block_size=block_size,
            sliding_window=sliding_window,
        )

    @cached_property
    def first_block_tensor(self) -> torch.Tensor:
        """`block_table_first_block` as an int32 tensor, built once per step for all layers."""
        return torch.tensor(self.block_table_first_block, dtype=torch.int32)

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

        def rebase(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            part = t[seq_lo : None if seq_hi is None else seq_hi + 1]
            return part - part[0]

        return AttentionMetadata.for_sequences(
            self.query_lens[seq_lo:seq_hi],
            self.context_lens[seq_lo:seq_hi],
            self.slot_mapping[tok_lo:tok_hi],
            self.block_tables[seq_lo:seq_hi],
            num_prefills=0 if decode else self.num_prefills,
            seq_lens_tensor=cut(self.seq_lens_tensor),
            query_start_loc=rebase(self.query_start_loc),
            seq_start_loc=rebase(self.seq_start_loc),
            context_lens_tensor=cut(self.context_lens_tensor),
            block_table_first_block=self.block_table_first_block[seq_lo:seq_hi],
            block_size=self.block_size,
            sliding_window=self.sliding_window,
            use_cuda_graph=self.use_cuda_graph,
            host_seq_lens=self.seq_lens is not None,
            max_decode_seq_len=self.max_decode_seq_len if decode else 0,
        )
