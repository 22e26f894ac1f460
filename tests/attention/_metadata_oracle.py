"""Test oracle for attention metadata: the list-building builder of docs/forward-context.md §3.

`ListMetadataBuilder` is the per-sequence form forward-context.md §3 describes (`prepare()`, one
`add_sequence(...)` per sequence, then `build(seq_lens, query_lens, cuda_graph_pad_size,
batch_size)`), written from plain Python lists. The engine no longer builds metadata this way
(`CommonMetadataBuilder` works over the runner's persistent buffers); tests use it as an
independent reference to compare the engine's metadata with, and where a backend kernel test
needs hand-made metadata.

`engine_metadata` makes the same metadata the engine's way: requests in an `InputBatch`,
`InputBatch.prepare` (and `pad` for graph batches), then `CommonMetadataBuilder`.
"""

from __future__ import annotations

import math

import torch

from tests._states import states_of
from tokenwise.attention.metadata import AttentionMetadata, CommonMetadataBuilder
from tokenwise.attention.utils import PAD_SLOT_ID, compute_slot_mapping
from tokenwise.engine.request import Request
from tokenwise.engine.step_outputs import ScheduledRequest
from tokenwise.runner.input_batch import InputBatch
from tokenwise.sampling.params import SamplingParams


class ListMetadataBuilder:
    """Accumulates one step's sequences as lists, then builds `AttentionMetadata` in one go."""

    def __init__(
        self, block_size: int, sliding_window: int | None = None, device: str = "cpu"
    ) -> None:
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.device = torch.device(device)
        self.prepare()

    def prepare(self) -> None:
        self.slot_mapping: list[int] = []
        self.block_tables: list[list[int]] = []
        self.full_block_tables: list[list[int]] = []  # untrimmed, for graph batches
        self.first_blocks: list[int] = []
        self.context_lens: list[int] = []
        self.query_lens: list[int] = []
        self.num_prefills = 0
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
        table = {seq_id: block_table}
        compute_slot_mapping(
            False, self.slot_mapping, seq_id, seq_len, context_len, 0, self.block_size, table
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
        else:
            self.num_decode_tokens += 1

    def build(
        self,
        seq_lens: list[int],
        query_lens: list[int],
        cuda_graph_pad_size: int = -1,
        batch_size: int = -1,
    ) -> AttentionMetadata:
        """With a graph the batch is padded with `cuda_graph_pad_size` one-token PAD rows to
        `batch_size`, and tables stay untrimmed (a graph's rows all start at block 0)."""
        if list(query_lens) != self.query_lens:
            raise ValueError("query_lens passed to build() differ from the added sequences")
        use_graph = cuda_graph_pad_size != -1
        slot_mapping, seq_lens = list(self.slot_mapping), list(seq_lens)
        query_lens, context_lens = list(query_lens), list(self.context_lens)
        tables, first_blocks = self.block_tables, list(self.first_blocks)
        if use_graph:
            if len(seq_lens) + cuda_graph_pad_size != batch_size:
                raise ValueError(f"{len(seq_lens)} + {cuda_graph_pad_size} != {batch_size}")
            tables, first_blocks = self.full_block_tables, [0] * len(first_blocks)
            pad = cuda_graph_pad_size
            slot_mapping += [PAD_SLOT_ID] * pad
            seq_lens, query_lens = seq_lens + [1] * pad, query_lens + [1] * pad
            context_lens, first_blocks = context_lens + [0] * pad, first_blocks + [0] * pad
        width = max((len(t) for t in tables), default=0)
        rows = [t + [0] * (width - len(t)) for t in tables]
        rows += [[0] * width] * (len(seq_lens) - len(rows))
        dev = self.device
        return AttentionMetadata.for_sequences(
            query_lens,
            context_lens,
            torch.tensor(slot_mapping, dtype=torch.int64, device=dev),
            torch.tensor(rows, dtype=torch.int32).reshape(len(seq_lens), width).to(dev),
            num_prefills=self.num_prefills,
            seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_table_first_block=first_blocks,
            block_size=self.block_size,
            sliding_window=self.sliding_window,
            use_cuda_graph=use_graph,
        )


def engine_metadata(
    block_size: int,
    seqs: list[tuple[int, int, list[int]]],
    sliding_window: int | None = None,
    graph_batch_size: int | None = None,
    batch: InputBatch | None = None,
) -> AttentionMetadata:
    """The engine's metadata for `seqs` = [(context_len, query_len, block_table), ...].

    Each sequence becomes a request in an `InputBatch` (a fresh one unless `batch` is given);
    `graph_batch_size` pads the step to that many one-token rows and builds graph metadata.
    """
    if batch is None:
        max_len = max(c + q for c, q, _ in seqs) + block_size
        tokens = max(sum(q for _, q, _ in seqs), graph_batch_size or 0)
        batch = InputBatch(max(len(seqs), graph_batch_size or 0), tokens, max_len, block_size,
                           torch.device("cpu"))  # fmt: skip
    items = []
    for i, (context, query, table) in enumerate(seqs):
        req = Request(f"seq{i}", list(range(context + query)), SamplingParams())
        req.num_computed_tokens = context
        # A request new to the batch: its whole table is this step's new blocks.
        items.append(ScheduledRequest(req, query, 0, (list(table),), (len(table),)))
    step = batch.prepare(items, states_of(items))
    pad = -1
    if graph_batch_size is not None:
        pad = graph_batch_size - len(seqs)
        step = batch.pad(step, step.num_tokens + pad)
    tables, first = step.block_tables, None
    if sliding_window is not None and pad == -1:
        tables, first = batch.windowed_block_tables(step, sliding_window)
    builder = CommonMetadataBuilder(block_size, sliding_window)
    builder.prepare()
    return builder.build(
        step.context_lens_np + step.query_lens_np,
        step.query_lens_np,
        pad,
        step.num_reqs if pad != -1 else -1,
        slot_mapping=step.slot_mapping,
        seq_lens_tensor=step.seq_lens,
        block_tables=tables,
        block_table_first_block=first,
    )
