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

        query_lens = self.query_lens[seq_lo:seq_hi]
        return AttentionMetadata(
            num_prefills=0 if decode else self.num_prefills,
            num_prefill_tokens=0 if decode else self.num_prefill_tokens,
            num_decode_tokens=self.num_decode_tokens if decode else 0,
            slot_mapping=self.slot_mapping[tok_lo:tok_hi],
            seq_lens=None if self.seq_lens is None else self.seq_lens[seq_lo:seq_hi],
            seq_lens_tensor=cut(self.seq_lens_tensor),
            max_query_len=max(query_lens, default=0),
            max_prefill_seq_len=0 if decode else self.max_prefill_seq_len,
            max_decode_seq_len=self.max_decode_seq_len if decode else 0,
            query_start_loc=rebase(self.query_start_loc),
            seq_start_loc=rebase(self.seq_start_loc),
            context_lens_tensor=cut(self.context_lens_tensor),
            block_tables=self.block_tables[seq_lo:seq_hi],
            use_cuda_graph=self.use_cuda_graph,
            query_lens=query_lens,
            context_lens=self.context_lens[seq_lo:seq_hi],
            block_table_first_block=self.block_table_first_block[seq_lo:seq_hi],
            block_size=self.block_size,
            sliding_window=self.sliding_window,
        )
