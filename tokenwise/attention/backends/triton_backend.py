"""GPU attention: SDPA per prefill, a Triton paged-decode kernel, graph-safe throughout decode.

Cache layout of one layer: `[2, num_blocks + 1, block_size, num_kv_heads, head_size]` (K then
V). Token-major blocks make the K/V write one `index_copy_` over flat slots (no Python loop, no
host sync), and the decode kernel still reads whole rows of `head_size` contiguous elements per
token and head, which is what coalesced loads want. The extra last block is the trash block that
PAD slots (padding rows, `PAD_SLOT_ID`) are written to, so no write ever needs a mask.

Prefill: one `scaled_dot_product_attention` per prompt (chunk). A fresh prompt uses
`is_causal=True`, and a chunk after cached context uses a lower-right causal bias, so both stay
eligible for SDPA's flash kernel on a GPU; only sliding windows need an explicit mask.

Decode: `triton_paged_decode.paged_decode` on CUDA with Triton, else the PyTorch reference
`paged_decode_reference` (same inputs, same semantics; also what tests compare the kernel with).
Both read only device tensors (`slot_mapping`, `seq_lens_tensor`, `block_tables`), so a decode
step can be captured whole in a CUDA graph and replayed on fresh metadata copied into the same
buffers (`supports_full_cudagraph`).
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

if TYPE_CHECKING:
    from tokenwise.attention.layer import Attention
    from tokenwise.attention.metadata import AttentionMetadata


@lru_cache(maxsize=1)
def triton_available() -> bool:
    """Whether Triton can be imported (it is never a dependency of tokenwise)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter K/V `[T, kv_heads, head]` to their slots; PAD slots land in the trash block."""
    flat_k = key_cache.view(-1, key.shape[1], key.shape[2])
    flat_v = value_cache.view(-1, value.shape[1], value.shape[2])
    slots = torch.where(slot_mapping < 0, flat_k.shape[0] - 1, slot_mapping)
    flat_k.index_copy_(0, slots, key.to(flat_k.dtype))
    flat_v.index_copy_(0, slots, value.to(flat_v.dtype))


def paged_decode_reference(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    first_block: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged keys, in plain PyTorch.

    q `[n, heads, head]`; caches `[blocks, block_size, kv_heads, head]`; `block_tables[i, j]` is
    the cache block of the sequence's logical block `first_block[i] + j` (0 when not given);
    `seq_lens[i]` counts the keys of sequence i, this step's included. No host reads.
    """
    n, num_heads, head_size = q.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    width = block_tables.shape[1] * block_size
    flat = block_tables.reshape(-1).to(torch.int64)
    keys = key_cache.index_select(0, flat).view(n, width, num_kv_heads, head_size)
    values = value_cache.index_select(0, flat).view(n, width, num_kv_heads, head_size)
    qg = q.view(n, num_kv_heads, group, head_size)
    scores = torch.matmul(qg.float(), keys.permute(0, 2, 3, 1).float()) * scale
    key_pos = torch.arange(width, device=q.device)[None, :]
    if first_block is not None:
        key_pos = key_pos + first_block.to(torch.int64)[:, None] * block_size
    lens = seq_lens.to(torch.int64)[:, None]
    visible = key_pos < lens
    if sliding_window is not None:
        visible = visible & (key_pos >= lens - sliding_window)
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, values.permute(0, 2, 1, 3).float())
    return out.reshape(n, num_heads, head_size).to(q.dtype)


class TritonAttentionImpl:
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None = None,
    ) -> None:
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.sliding_window = sliding_window

    def forward(
        self,
        layer: Attention,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata | None,
    ) -> torch.Tensor:
        if attn_metadata is None:  # profiling / warm-up pass: no cache, one sequence
            return layer._single_sequence_attention(query, key, value)
        num_tokens = query.shape[0]
        q = query.view(num_tokens, self.num_heads, self.head_size)
        k = key.view(num_tokens, self.num_kv_heads, self.head_size)
        v = value.view(num_tokens, self.num_kv_heads, self.head_size)
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        write_kv(k, v, key_cache, value_cache, attn_metadata.slot_mapping[:num_tokens])
        output = torch.empty_like(q)
        n_prefill = attn_metadata.num_prefill_tokens
        if attn_metadata.num_prefills:
            self._prefill(q[:n_prefill], k, v, key_cache, value_cache, attn_metadata, output)
        if attn_metadata.num_decode_tokens:
            output[n_prefill:] = self._decode(q[n_prefill:], key_cache, value_cache, attn_metadata)
        return output.view(num_tokens, self.num_heads * self.head_size)

    def _decode(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        md: AttentionMetadata,
    ) -> torch.Tensor:
        lo, hi = md.num_prefills, md.num_prefills + q.shape[0]
        tables = md.block_tables[lo:hi]
        assert md.seq_lens_tensor is not None
        seq_lens = md.seq_lens_tensor[lo:hi]
        first_block = None
        if self.sliding_window is not None and not md.use_cuda_graph:
            # Eager steps trim windowed tables (graph steps keep them whole): say where each
            # row starts. A host-to-device copy, which is why it is not done under a graph.
            starts = md.block_table_first_block[lo:hi]
            if any(starts):
                first_block = torch.tensor(starts, dtype=torch.int32).to(q.device)
        if q.is_cuda and triton_available():
            from tokenwise.attention.backends.triton_paged_decode import paged_decode

            return paged_decode(
                q,
                key_cache,
                value_cache,
                tables,
                seq_lens,
                self.scale,
                self.sliding_window,
                first_block,
            )
        return paged_decode_reference(
            q,
            key_cache,
            value_cache,
            tables,
            seq_lens,
            self.scale,
            self.sliding_window,
            first_block,
        )

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        md: AttentionMetadata,
        output: torch.Tensor,
    ) -> None:
        block_size = md.block_size
        start = 0
        for i in range(md.num_prefills):
            q_len, ctx_len = md.query_lens[i], md.context_lens[i]
            end = start + q_len
            key_offset = 0
            if ctx_len == 0:
                keys, values = k[start:end], v[start:end]
            else:
                first = md.block_table_first_block[i]
                n_blocks = -(-(ctx_len + q_len) // block_size) - first
                table = md.block_tables[i, :n_blocks].to(torch.int64)
                key_offset = first * block_size
                n_keys = ctx_len + q_len - key_offset
                keys = key_cache.index_select(0, table).flatten(0, 1)[:n_keys]
                values = value_cache.index_select(0, table).flatten(0, 1)[:n_keys]
            output[start:end] = self._attend(q[start:end], keys, values, ctx_len, key_offset)
            start = end

    def _attend(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, ctx_len: int, offset: int
    ) -> torch.Tensor:
        """Causal attention of queries at positions ctx_len.. over keys at offset.."""
        q_len, n_keys = q.shape[0], keys.shape[0]
        mask: torch.Tensor | None = None
        is_causal = False
        if self.sliding_window is not None:
            q_pos = torch.arange(ctx_len, ctx_len + q_len, device=q.device)[:, None]
            k_pos = torch.arange(offset, offset + n_keys, device=q.device)[None, :]
            mask = (k_pos <= q_pos) & (k_pos > q_pos - self.sliding_window)
        elif n_keys == q_len:
            is_causal = True
        else:
            mask = causal_lower_right(q_len, n_keys)  # type: ignore[assignment]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            keys.transpose(0, 1),
            values.transpose(0, 1),
            attn_mask=mask,
            is_causal=is_causal,
            scale=self.scale,
            enable_gqa=self.group > 1,
        )
        return out.transpose(0, 1)


class TritonAttentionBackend:
    name = "triton"
    supports_full_cudagraph = True

    @staticmethod
    def get_impl_cls() -> type[TritonAttentionImpl]:
        return TritonAttentionImpl

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        """Shape of one layer's cache; one extra trash block receives PAD writes."""
        return (2, num_blocks + 1, block_size, num_kv_heads, head_size)
