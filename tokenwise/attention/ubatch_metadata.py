"""The attention metadata of one micro-batch, cut out of the whole step's metadata.

The runner builds a step's `AttentionMetadata` once, then (when it micro-batches) runs the model
on each `UBatchSlice` in turn. Each run needs metadata that describes only its own tokens, and a
request cut by the boundary must look, to each run, like a request of its own: the first part
sees the cached context plus its own tokens, the second part sees the first part as context
(micro-batch 0 wrote it to the paged cache). Block tables and slots are unchanged: the tokens
keep their positions, only the split of "context" and "query" moves.
"""

from __future__ import annotations

from itertools import pairwise
from typing import overload

import torch

from tokenwise.attention.metadata import AttentionMetadata
from tokenwise.distributed.ubatching import UBatchSlice, split_request_lengths

__all__ = ["split_attention_metadata", "split_metadata_by_layer"]


def split_attention_metadata(md: AttentionMetadata, ubatch: UBatchSlice) -> AttentionMetadata:
    """Metadata of the requests and tokens of `ubatch`, consistent with running it alone.

    Lengths come from `split_request_lengths`, so a split request's first part ends its
    sequence where its part of the query ends, and its second part counts the first part as
    cached context. `seq_lens_tensor` is rebuilt on md's device (None stays None); the start
    locations and context lengths derive from the part's own host lengths when read.
    """
    num_reqs, num_tokens = md.num_seqs, sum(md.query_lens)
    r0, r1 = ubatch.request_slice.start, ubatch.request_slice.stop
    t0, t1 = ubatch.token_slice.start, ubatch.token_slice.stop
    if ubatch.is_empty() or r1 <= r0:
        raise ValueError(f"{ubatch} is empty; an empty micro-batch has no attention metadata")
    if not (0 <= r0 < r1 <= num_reqs and 0 <= t0 < t1 <= num_tokens):
        raise ValueError(
            f"{ubatch} reaches beyond the batch ({num_reqs} requests, {num_tokens} tokens)"
        )
    # Host-side lists: reading md's device tensors here would cost a device sync per step.
    qsl = [0]
    for q in md.query_lens:
        qsl.append(qsl[-1] + q)
    seq_lens = [c + q for c, q in zip(md.context_lens, md.query_lens, strict=True)]
    part_qsl, part_seq_lens = split_request_lengths(qsl, seq_lens, ubatch)
    assert isinstance(part_qsl, list) and isinstance(part_seq_lens, list)
    query_lens = [b - a for a, b in pairwise(part_qsl)]
    context_lens = [s - q for s, q in zip(part_seq_lens, query_lens, strict=True)]

    dev = md.slot_mapping.device

    def rebuilt(like: torch.Tensor | None, values: list[int]) -> torch.Tensor | None:
        return None if like is None else torch.tensor(values, dtype=like.dtype, device=dev)

    host_seq_lens = md.seq_lens is not None
    # Sliding window: rows keep md's first block. The first block is computed from the
    # request's earliest query position (`context_len`), and a split request's first part
    # starts at that same position, so it still has every block it can see; the second part
    # starts later, so its window begins at or after that block (the mask hides the extra).
    return AttentionMetadata.for_sequences(
        query_lens,
        context_lens,
        md.slot_mapping[t0:t1],
        md.block_tables[r0:r1],
        # A prefill's part may be a single token; it still belongs to the prefill section.
        num_prefills=max(0, min(r1, md.num_prefills) - r0),
        seq_lens_tensor=rebuilt(md.seq_lens_tensor, part_seq_lens),
        block_table_first_block=md.block_table_first_block[r0:r1],
        block_size=md.block_size,
        sliding_window=md.sliding_window,
        use_cuda_graph=md.use_cuda_graph,
        host_seq_lens=host_seq_lens,
        # Graph metadata declares its longest decode instead of deriving it from host lengths.
        max_decode_seq_len=None if host_seq_lens else md.max_decode_seq_len,
    )


@overload
def split_metadata_by_layer(
    attn_metadata: dict[str, AttentionMetadata], ubatch: UBatchSlice
) -> dict[str, AttentionMetadata]: ...
@overload
def split_metadata_by_layer(
    attn_metadata: AttentionMetadata, ubatch: UBatchSlice
) -> AttentionMetadata: ...
@overload
def split_metadata_by_layer(attn_metadata: None, ubatch: UBatchSlice) -> None: ...
def split_metadata_by_layer(
    attn_metadata: dict[str, AttentionMetadata] | AttentionMetadata | None, ubatch: UBatchSlice
) -> dict[str, AttentionMetadata] | AttentionMetadata | None:
    """Split the forward context's metadata: one object, a per-layer dict, or None.

    Layers with the same attention spec share one metadata object; each distinct object is
    split once and the layers that shared it share the split one, so the per-step cost stays
    one split per spec and per-object caches (`first_block_tensor`) stay shared too. None (a
    profiling / warm-up pass) stays None.
    """
    if attn_metadata is None:
        return None
    if isinstance(attn_metadata, AttentionMetadata):
        return split_attention_metadata(attn_metadata, ubatch)
    done: dict[int, AttentionMetadata] = {}
    out: dict[str, AttentionMetadata] = {}
    for name, md in attn_metadata.items():
        if id(md) not in done:
            done[id(md)] = split_attention_metadata(md, ubatch)
        out[name] = done[id(md)]
    return out
