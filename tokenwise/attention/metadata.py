"""Attention metadata for one forward pass, and the builder that makes it once per step.

Sequences are laid out prefills first, then decodes, so that a backend can split the flat token
stream at `num_prefill_tokens` and run each half with the kernel suited to it. A decode is a
sequence with query length 1; a chunk of a prompt (context > 0, query > 1) is a prefill.

All layers that share an attention spec (block size, sliding window) share one metadata object;
the runner builds one per distinct spec per step.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from tokenwise.attention.attn_metadata import AttentionMetadata
from tokenwise.attention.graph_state import CommonAttentionState
from tokenwise.attention.utils import PAD_SLOT_ID, compute_slot_mapping

__all__ = ["AttentionMetadata", "CommonAttentionState", "CommonMetadataBuilder"]


class CommonMetadataBuilder:
    """Accumulates one step's sequences, then builds `AttentionMetadata` in one go.

    Usage per step: `prepare()`, one `add_sequence(...)` per scheduled sequence (prefills
    first), then `build(...)`. Every token's K/V is written to the cache, also under a sliding
    window: blocks are never recycled inside a request and prefix caching shares full blocks,
    so a cached block must hold all of its tokens.
    """

    def __init__(
        self,
        block_size: int,
        sliding_window: int | None = None,
        device: torch.device | str = "cpu",
        attn_state: CommonAttentionState | None = None,
    ) -> None:
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.device = torch.device(device)
        self.attn_state = attn_state
        self.prepare()

    def prepare(self) -> None:
        self.slot_mapping: list[int] = []
        self.block_tables: list[list[int]] = []
        self.full_block_tables: list[list[int]] = []  # untrimmed, for graph batches
        self.first_blocks: list[int] = []
        self.context_lens: list[int] = []
        self.query_lens: list[int] = []
        self.num_prefills = 0
        self.num_prefill_tokens = 0
        self.num_decode_tokens = 0

    def add_sequence(
        self, seq_id: int, context_len: int, query_len: int, block_table: list[int]
    ) -> None:
        """Add a sequence computing `query_len` new tokens after `context_len` cached ones."""
        if query_len < 1:
            raise ValueError(f"query_len must be >= 1, got {query_len} (sequence {seq_id})")
        is_prefill = query_len > 1
        if is_prefill and self.num_decode_tokens:
            raise ValueError("prefill sequences must be added before decode sequences")
        seq_len = context_len + query_len
        compute_slot_mapping(
            False,
            self.slot_mapping,
            seq_id,
            seq_len,
            context_len,
            0,
            self.block_size,
            {seq_id: block_table},
        )
        first = 0
        if self.sliding_window is not None:
            # The earliest query (position context_len) sees keys > context_len - window.
            first = max(0, context_len - self.sliding_window + 1) // self.block_size
        num_blocks = math.ceil(seq_len / self.block_size)
        self.block_tables.append(block_table[first:num_blocks])
        self.full_block_tables.append(block_table[:num_blocks])
        self.first_blocks.append(first)
        self.context_lens.append(context_len)
        self.query_lens.append(query_len)
        if is_prefill:
            self.num_prefills += 1
            self.num_prefill_tokens += query_len
        else:
            self.num_decode_tokens += 1

    def build(
        self,
        seq_lens: list[int],
        query_lens: list[int],
        cuda_graph_pad_size: int = -1,
        batch_size: int = -1,
    ) -> AttentionMetadata:
        """Tensors for the step. With a graph (`cuda_graph_pad_size != -1`) the decode batch is
        padded to `batch_size` with PAD slots and block tables go to the persistent buffer."""
        if list(query_lens) != self.query_lens:
            raise ValueError("query_lens passed to build() differ from the added sequences")
        use_graph = cuda_graph_pad_size != -1
        slot_mapping = list(self.slot_mapping)
        seq_lens = list(seq_lens)
        query_lens = list(query_lens)
        block_tables = self.block_tables
        first_blocks = list(self.first_blocks)
        context_lens = list(self.context_lens)
        if use_graph:
            # A captured graph keeps the host-side fields of its capture metadata, where every
            # row starts at block 0; so graph batches use untrimmed tables (the window mask
            # still applies).
            block_tables = self.full_block_tables
            first_blocks = [0] * len(first_blocks)
            slot_mapping.extend([PAD_SLOT_ID] * cuda_graph_pad_size)
            seq_lens.extend([1] * cuda_graph_pad_size)
            query_lens.extend([1] * cuda_graph_pad_size)
            context_lens.extend([0] * cuda_graph_pad_size)
            first_blocks.extend([0] * cuda_graph_pad_size)
        max_blocks = max((len(t) for t in block_tables), default=0)
        if use_graph and self.attn_state is not None:
            table_tensor = self.attn_state.write_block_tables(block_tables, batch_size)
        else:
            rows = [t + [0] * (max_blocks - len(t)) for t in block_tables]
            rows += [[0] * max_blocks] * (len(seq_lens) - len(rows))
            table_tensor = torch.tensor(rows, dtype=torch.int32).reshape(len(seq_lens), max_blocks)
        dev = self.device
        query_start = [0]
        for q in query_lens:
            query_start.append(query_start[-1] + q)
        seq_start = [0]
        for s in seq_lens:
            seq_start.append(seq_start[-1] + s)
        return AttentionMetadata.for_sequences(
            query_lens,
            context_lens,
            torch.tensor(slot_mapping, dtype=torch.int64, device=dev),
            table_tensor.to(dev, non_blocking=True),
            num_prefills=self.num_prefills,
            seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            seq_start_loc=torch.tensor(seq_start, dtype=torch.int32, device=dev),
            context_lens_tensor=torch.tensor(context_lens, dtype=torch.int32, device=dev),
            block_table_first_block=first_blocks,
            block_size=self.block_size,
            sliding_window=self.sliding_window,
            use_cuda_graph=use_graph,
        )

    def build_from_buffers(
        self,
        slot_mapping: torch.Tensor,
        seq_lens_tensor: torch.Tensor,
        query_start_loc: torch.Tensor,
        block_tables: torch.Tensor,
        query_lens: np.ndarray,
        context_lens: np.ndarray,
        block_table_first_block: list[int] | None = None,
    ) -> AttentionMetadata:
        """Metadata over a step's persistent input buffers (the runner's `InputBatch`).

        The tensors are the buffers' device views, used as they are: nothing is rebuilt from
        Python lists. Sequences must come prefills first. `block_table_first_block` is given
        for window-trimmed tables (rows then start at that logical block).
        """
        seq_start = np.zeros(len(query_lens) + 1, dtype=np.int32)
        np.cumsum(context_lens + query_lens, out=seq_start[1:])
        dev = slot_mapping.device
        return AttentionMetadata.for_sequences(
            query_lens.tolist(),
            context_lens.tolist(),
            slot_mapping,
            block_tables,
            seq_lens_tensor=seq_lens_tensor,
            query_start_loc=query_start_loc,
            seq_start_loc=torch.from_numpy(seq_start).to(dev, non_blocking=True),
            context_lens_tensor=torch.from_numpy(context_lens.astype(np.int32)).to(
                dev, non_blocking=True
            ),
            block_table_first_block=block_table_first_block,
            block_size=self.block_size,
            sliding_window=self.sliding_window,
        )
