"""Attention of encoder-decoder models: the encoder's self-attention and the decoder's
cross-attention over a paged cross KV cache.

An encoder runs once per request, in the step that admits it (again after a preemption). Its
self-attention (`AttentionType.ENCODER`) is bidirectional within each encoder of the step and
keeps nothing. Each decoder layer's cross-attention (`AttentionType.ENCODER_DECODER`) projects
the encoder output to keys and values once, in that same step, and writes them into the layer's
cross cache at `cross_slot_mapping`; every later decoder step passes no encoder tokens at all and
reads them back through the request's cross block table. Cross-attention is never causal: a
decoder token sees every encoder token of its own request, and none of another's.

Where each of those lives in the step's metadata is read through the helpers of
docs/forward-context.md §3 (`get_num_prefill_decode_query_kv_tokens`,
`get_seq_len_block_table_args`, `is_all_encoder_attn_metadata_set`,
`is_all_cross_attn_metadata_set`), the fields they name being set by the encoder-decoder runner. The
cross cache has the decoder cache's layout (`torch_backend`: K then V, token-major blocks, a trash
block for PAD slots).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tokenwise.attention.backends.encoder_only import attend_within_sequences
from tokenwise.attention.backends.torch_backend import paged_decode_reference, write_kv_cache
from tokenwise.attention.utils import (
    AttentionType,
    get_num_prefill_decode_query_kv_tokens,
    get_seq_len_block_table_args,
    is_all_cross_attn_metadata_set,
    is_all_encoder_attn_metadata_set,
)

if TYPE_CHECKING:
    from tokenwise.attention.metadata import AttentionMetadata


def attend_all(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    scale: float,
) -> torch.Tensor:
    """Every query row sees every key row (no mask); q and k may differ in length."""
    q = query.reshape(-1, num_heads, head_size).transpose(0, 1)
    k = key.reshape(-1, num_kv_heads, head_size).transpose(0, 1)
    v = value.reshape(-1, num_kv_heads, head_size).transpose(0, 1)
    out = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=num_kv_heads != num_heads)
    return out.transpose(0, 1).reshape(query.shape[0], num_heads * head_size)


class EncoderDecoderAttentionImpl:
    """One layer's encoder self-attention or decoder cross-attention; tensors in, tensors out."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        attn_type: AttentionType,
    ) -> None:
        if attn_type not in (AttentionType.ENCODER, AttentionType.ENCODER_DECODER):
            raise ValueError(f"not an encoder-decoder attention type: {attn_type!r}")
        self.attn_type = attn_type
        self.settings = {
            "num_heads": num_heads,
            "num_kv_heads": num_kv_heads,
            "head_size": head_size,
            "scale": scale,
        }

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata | None,
    ) -> torch.Tensor:
        """`[num_query_tokens, heads * head]`; without metadata, q attends to all of k/v."""
        if attn_metadata is None:
            return attend_all(query, key, value, **self.settings)
        if self.attn_type is AttentionType.ENCODER:
            return self._encoder(query, key, value, attn_metadata)
        return self._cross(query, key, value, kv_cache, attn_metadata)

    def _encoder(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        if not is_all_encoder_attn_metadata_set(md):
            raise ValueError("encoder attention needs the encoder fields of the metadata set")
        num_tokens, _, _ = get_num_prefill_decode_query_kv_tokens(md, AttentionType.ENCODER)
        if query.shape[0] != num_tokens:
            raise ValueError(f"encoder step has {query.shape[0]} tokens, metadata {num_tokens}")
        assert md.encoder_seq_lens is not None  # checked above
        return attend_within_sequences(query, key, value, md.encoder_seq_lens, **self.settings)

    def _cross(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
    ) -> torch.Tensor:
        """Write this step's encoder K/V (if any encoder ran), then attend from the cache."""
        if not is_all_cross_attn_metadata_set(md):
            raise ValueError("cross-attention needs the encoder and cross fields of the metadata")
        num_prefill, num_encoder, num_decode = get_num_prefill_decode_query_kv_tokens(
            md, AttentionType.ENCODER_DECODER
        )
        if key.shape[0] != num_encoder:
            raise ValueError(f"got K/V of {key.shape[0]} encoder tokens, metadata {num_encoder}")
        heads, kv_heads = self.settings["num_heads"], self.settings["num_kv_heads"]
        head = self.settings["head_size"]
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        if num_encoder:
            assert md.cross_slot_mapping is not None  # checked above
            write_kv_cache(
                key.view(-1, kv_heads, head),
                value.view(-1, kv_heads, head),
                key_cache,
                value_cache,
                md.cross_slot_mapping,
            )
        enc_lens, _, tables = get_seq_len_block_table_args(md, False, AttentionType.ENCODER_DECODER)
        q = query.view(-1, heads, head)
        out = torch.empty_like(q)
        assert md.encoder_seq_lens is not None
        start = 0
        for i in range(md.num_prefills):  # multi-token queries: one call per sequence
            end = start + md.query_lens[i]
            n_keys = md.encoder_seq_lens[i]
            row = tables[i, : -(-n_keys // md.block_size)].to(torch.int64)
            keys = key_cache.index_select(0, row).flatten(0, 1)[:n_keys]
            values = value_cache.index_select(0, row).flatten(0, 1)[:n_keys]
            out[start:end] = attend_all(q[start:end], keys, values, **self.settings).view(
                -1, heads, head
            )
            start = end
        if num_decode:  # one query each: the paged decode, with the encoder length as length
            lo = md.num_prefills
            out[num_prefill:] = paged_decode_reference(
                q[num_prefill:],
                key_cache,
                value_cache,
                tables[lo:],
                enc_lens[lo:],
                self.settings["scale"],
            )
        return out.view(-1, heads * head)
