"""Multi-head latent attention (DeepSeek-V2/V3) over a paged *latent* cache, in plain PyTorch.

MLA caches one vector per token and layer, `[c_kv (kv_lora_rank) | k_pe (qk_rope_head_dim)]`:
the normalised KV latent and the single rotary key part shared by all heads. Keys and values of
every head are linear in `c_kv` (`kv_b_proj`, whose rows per head are `[W_UK (qk_nope) |
W_UV (v_head)]`), so they need not be stored. Cache layout: `[num_blocks + 1, block_size,
kv_lora_rank + qk_rope_head_dim]`, the extra last block being the trash block that PAD slots
(-1) are written to, as in `torch_backend`.

Two ways to attend, mathematically equal:

- expanded (prefill): gather the sequence's latent rows, expand them with `kv_b_proj` into
  per-head `k_nope` and `v`, append `k_pe` to every head's key, and run causal SDPA. Prefill
  has many queries per key, so expanding each key once is the cheaper order.
- absorbed (decode): with one query per sequence, expanding every cached key would dominate.
  Instead `W_UK` is folded into the query (`q_latent = q_nope @ W_UK`, per head), scores are
  `(q_latent . c_kv + q_pe . k_pe) * scale` straight over the cached rows, the probabilities
  average the latents (`probs @ c_kv`), and `W_UV` maps that average to each head's value.

The impl gets tensors (queries, latents, `kv_b_proj`'s weight, the cache) and the step's
metadata, never the attention layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from tokenwise.attention.backends.paged_rows import len_blocks

if TYPE_CHECKING:
    from tokenwise.attention.metadata import AttentionMetadata


@dataclass(frozen=True)
class MLAHeadDims:
    """Per-head sizes of one MLA layer (this rank's heads)."""

    num_heads: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    kv_lora_rank: int

    @property
    def latent_size(self) -> int:
        """Elements cached per token: the KV latent plus the shared rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def split_kv_b(self, kv_b_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views `(W_UK [heads, qk_nope, L], W_UV [heads, v_head, L])` of `kv_b_proj.weight`.

        Views, not copies: they follow the parameter, and cost nothing per step.
        """
        per_head = kv_b_weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, -1)
        return per_head[:, : self.qk_nope_head_dim], per_head[:, self.qk_nope_head_dim :]


def mla_kv_cache_shape(num_blocks: int, block_size: int, dims: MLAHeadDims) -> tuple[int, ...]:
    """One layer's latent cache; one extra trash block receives PAD writes."""
    return (num_blocks + 1, block_size, dims.latent_size)


def expand_latent(
    kv_c: torch.Tensor, k_pe: torch.Tensor, kv_b_weight: torch.Tensor, dims: MLAHeadDims
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys `[n, heads, qk_nope + rope]` and values `[n, heads, v_head]` of `n` latent rows."""
    n = kv_c.shape[0]
    kv = F.linear(kv_c, kv_b_weight).view(n, dims.num_heads, -1)
    k_nope, v = kv.split([dims.qk_nope_head_dim, dims.v_head_dim], dim=-1)
    k_rope = k_pe.view(n, 1, dims.qk_rope_head_dim).expand(n, dims.num_heads, -1)
    return torch.cat((k_nope, k_rope), dim=-1), v


def attend_expanded(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of the last `q_len` positions over `n_keys` keys (bottom-right aligned:
    the queries are the sequence's newest tokens). q `[q_len, h, d]` -> `[q_len, h, v_head]`."""
    q_len, n_keys = q.shape[0], k.shape[0]
    mask = None if n_keys == q_len else causal_lower_right(q_len, n_keys)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
    )
    return out.transpose(0, 1)


def mla_single_sequence(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_b_weight: torch.Tensor,
    dims: MLAHeadDims,
    scale: float,
) -> torch.Tensor:
    """All tokens as one causal sequence with no cache (no forward context, profiling)."""
    n = q.shape[0]
    k, v = expand_latent(kv_c, k_pe, kv_b_weight, dims)
    out = attend_expanded(q.view(n, dims.num_heads, -1), k, v, scale)
    return out.reshape(n, dims.num_heads * dims.v_head_dim)


def absorbed_decode(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_b_weight: torch.Tensor,
    dims: MLAHeadDims,
    scale: float,
) -> torch.Tensor:
    """One query per sequence over its paged latent rows, with `W_UK`/`W_UV` absorbed.

    q `[n, heads, qk_nope + rope]`; `block_tables[i]` the cache blocks of sequence i (padded
    with any block), `seq_lens[i]` its key count, this step's included. No host reads, so it
    can run inside a captured CUDA graph. Returns `[n, heads, v_head]`.
    """
    n = q.shape[0]
    block_size = latent_cache.shape[1]
    w_uk, w_uv = dims.split_kv_b(kv_b_weight)
    q_nope, q_pe = q.split([dims.qk_nope_head_dim, dims.qk_rope_head_dim], dim=-1)
    # [heads, n, nope] @ [heads, nope, L] -> the query in latent space, per head.
    q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
    q_full = torch.cat((q_latent, q_pe), dim=-1)  # [n, heads, L + rope]
    width = block_tables.shape[1] * block_size
    flat = block_tables.reshape(-1).to(torch.int64)
    rows = latent_cache.index_select(0, flat).view(n, width, dims.latent_size)
    scores = torch.bmm(q_full, rows.transpose(1, 2)).float() * scale  # [n, heads, width]
    visible = torch.arange(width, device=q.device)[None, :] < seq_lens.to(torch.int64)[:, None]
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(rows.dtype)
    out_latent = torch.bmm(probs, rows[..., : dims.kv_lora_rank])  # [n, heads, L]
    # [heads, n, L] @ [heads, L, v] -> each head's value.
    out = torch.bmm(out_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
    return out.to(q.dtype)


class MLAImpl:
    """One MLA layer's attention: sizes and scale fixed at construction, inputs are tensors."""

    def __init__(self, dims: MLAHeadDims, scale: float) -> None:
        self.dims = dims
        self.scale = scale

    def forward(
        self,
        q: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        kv_b_weight: torch.Tensor,
        latent_cache: torch.Tensor,
        attn_metadata: AttentionMetadata | None,
    ) -> torch.Tensor:
        """Write this step's latents, then attend. q `[T, heads * (nope + rope)]`, kv_c
        `[T, kv_lora_rank]` (normalised), k_pe `[T, rope]` (rotated); `[T, heads * v_head]`."""
        dims = self.dims
        if attn_metadata is None:  # profiling / warm-up pass: no cache, one sequence
            return mla_single_sequence(q, kv_c, k_pe, kv_b_weight, dims, self.scale)
        md = attn_metadata
        num_tokens = q.shape[0]
        q = q.view(num_tokens, dims.num_heads, -1)
        write_latent_cache(kv_c, k_pe, latent_cache, md.slot_mapping[:num_tokens])
        output = q.new_empty(num_tokens, dims.num_heads, dims.v_head_dim)
        n_prefill = md.num_prefill_tokens
        if md.num_prefills:
            self._prefill(q, kv_c, k_pe, kv_b_weight, latent_cache, md, output)
        if md.num_decode_tokens:
            lo, hi = md.num_prefills, md.num_prefills + md.num_decode_tokens
            assert md.seq_lens_tensor is not None
            output[n_prefill:] = absorbed_decode(
                q[n_prefill:],
                latent_cache,
                md.block_tables[lo:hi],
                md.seq_lens_tensor[lo:hi],
                kv_b_weight,
                dims,
                self.scale,
            )
        return output.view(num_tokens, dims.num_heads * dims.v_head_dim)

    def _prefill(
        self,
        q: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        kv_b_weight: torch.Tensor,
        latent_cache: torch.Tensor,
        md: AttentionMetadata,
        output: torch.Tensor,
    ) -> None:
        """Per prefill sequence: its latents (cached context included) expanded, then SDPA."""
        lora = self.dims.kv_lora_rank
        start = 0
        for i in range(md.num_prefills):
            q_len, ctx_len = md.query_lens[i], md.context_lens[i]
            end = start + q_len
            if ctx_len == 0:
                seq_c, seq_pe = kv_c[start:end], k_pe[start:end]
            else:  # this step's rows were written above, so the cache holds the whole sequence
                table = md.block_tables[i, : len_blocks(md, i)]
                rows = latent_cache.index_select(0, table).flatten(0, 1)[: ctx_len + q_len]
                seq_c, seq_pe = rows[:, :lora], rows[:, lora:]
            k, v = expand_latent(seq_c, seq_pe, kv_b_weight, self.dims)
            output[start:end] = attend_expanded(q[start:end], k, v, self.scale)
            start = end


def write_latent_cache(
    kv_c: torch.Tensor, k_pe: torch.Tensor, latent_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter `[kv_c | k_pe]` of this step's tokens into their slots; PAD (-1) to the trash."""
    flat = latent_cache.view(-1, latent_cache.shape[-1])
    trash_slot = flat.shape[0] - 1
    slots = torch.where(slot_mapping < 0, trash_slot, slot_mapping)
    flat.index_copy_(0, slots, torch.cat((kv_c, k_pe), dim=-1).to(flat.dtype))
