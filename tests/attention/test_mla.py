"""Multi-head latent attention against plain dense attention with the keys written out.

The reference builds every head's key and value from the test's own latents in float64:
`k = [W_UK c_kv, k_pe]`, `v = W_UV c_kv` (per head, from the rows of `kv_b_proj`), then
`softmax(q k^T * scale + causal mask) v`; it never reads the cache. Blocks come from a shuffled
permutation (non-contiguous tables), and the cache starts filled with finite garbage, so a read
of a slot that was never written shows up.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tests.attention._metadata_oracle import ListMetadataBuilder
from tokenwise.attention.backends.mla_backend import (
    MLAHeadDims,
    MLAImpl,
    absorbed_decode,
    mla_kv_cache_shape,
)
from tokenwise.attention.metadata import AttentionMetadata
from tokenwise.attention.mla import MLAAttention
from tokenwise.attention.utils import PAD_SLOT_ID
from tokenwise.config import EngineConfig
from tokenwise.forward_context import set_forward_context

DIMS = MLAHeadDims(num_heads=4, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                   kv_lora_rank=32)  # fmt: skip
QK = DIMS.qk_nope_head_dim + DIMS.qk_rope_head_dim
SCALE = 0.3
B, NUM_BLOCKS = 4, 40


@dataclass
class Seq:
    seq_id: int
    q: torch.Tensor  # [n, heads, qk]  queries of every position
    c: torch.Tensor  # [n, kv_lora_rank]
    pe: torch.Tensor  # [n, rope]
    table: list[int]


def reference(seq: Seq, w: torch.Tensor, ctx: int, q_len: int) -> torch.Tensor:
    """Dense causal attention of positions ctx .. ctx+q_len-1 with the keys expanded by hand."""
    n = ctx + q_len
    per_head = w.double().view(DIMS.num_heads, DIMS.qk_nope_head_dim + DIMS.v_head_dim, -1)
    w_k, w_v = per_head[:, : DIMS.qk_nope_head_dim], per_head[:, DIMS.qk_nope_head_dim :]
    c, pe = seq.c[:n].double(), seq.pe[:n].double()
    k_nope = torch.einsum("hdl,kl->khd", w_k, c)
    k = torch.cat([k_nope, pe[:, None, :].expand(n, DIMS.num_heads, -1)], dim=-1)
    v = torch.einsum("hdl,kl->khd", w_v, c)
    scores = torch.einsum("qhd,khd->hqk", seq.q[ctx:n].double(), k) * SCALE
    allowed = torch.arange(n)[None, :] <= torch.arange(ctx, n)[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def make_seqs(lengths: list[int], gen: torch.Generator) -> list[Seq]:
    perm = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    seqs = []
    for i, n in enumerate(lengths):
        nb = -(-n // B)
        table, perm = perm[:nb], perm[nb:]
        seqs.append(
            Seq(
                i,
                torch.randn(n, DIMS.num_heads, QK, generator=gen),
                torch.randn(n, DIMS.kv_lora_rank, generator=gen),
                torch.randn(n, DIMS.qk_rope_head_dim, generator=gen),
                table,
            )
        )
    return seqs


def setup(seed: int, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[Seq]]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(DIMS.num_heads * (DIMS.qk_nope_head_dim + DIMS.v_head_dim),
                    DIMS.kv_lora_rank, generator=gen) * 0.3  # fmt: skip
    cache = torch.randn(mla_kv_cache_shape(NUM_BLOCKS, B, DIMS), generator=gen) * 10
    return w, cache, make_seqs(lengths, gen)


def step_inputs(items: list[tuple[Seq, int, int]]) -> tuple[torch.Tensor, ...]:
    def cat(name: str) -> torch.Tensor:
        return torch.cat([getattr(s, name)[c : c + q] for s, c, q in items])

    return cat("q").flatten(1), cat("c"), cat("pe")


def build_md(items: list[tuple[Seq, int, int]]) -> AttentionMetadata:
    builder = ListMetadataBuilder(B)
    for seq, ctx, ql in items:
        builder.add_sequence(seq.seq_id, ctx, ql, seq.table)
    return builder.build([c + q for _, c, q in items], [q for _, _, q in items])


def run_step(
    w: torch.Tensor, cache: torch.Tensor, items: list[tuple[Seq, int, int]]
) -> tuple[list[torch.Tensor], AttentionMetadata]:
    md = build_md(items)
    out = MLAImpl(DIMS, SCALE).forward(*step_inputs(items), w, cache, md)
    assert out.shape == (sum(q for _, _, q in items), DIMS.num_heads * DIMS.v_head_dim)
    view = out.view(-1, DIMS.num_heads, DIMS.v_head_dim)
    return list(view.split([q for _, _, q in items])), md


def check(w: torch.Tensor, outs: list[torch.Tensor], items: list[tuple[Seq, int, int]]) -> None:
    for out, (seq, ctx, ql) in zip(outs, items, strict=True):
        torch.testing.assert_close(out.double(), reference(seq, w, ctx, ql), atol=1e-5, rtol=1e-5)


def test_cache_holds_one_latent_row_per_token() -> None:
    assert mla_kv_cache_shape(10, 16, DIMS) == (11, 16, 32 + 8)  # one trash block
    layer = MLAAttention(DIMS, SCALE, prefix="model.layers.0.self_attn.attn")
    assert layer.kv_cache_shape(10, 16) == (11, 16, 40)


@pytest.mark.parametrize("lengths", [[1], [4, 5], [3, 8, 13, 17, 2]])
def test_absorbed_decode_equals_expanded_attention(lengths: list[int]) -> None:
    """Each sequence's last token over its paged latents, several lengths (block boundaries
    at 4 and 8), against the expanded reference."""
    w, cache, seqs = setup(sum(lengths), lengths)
    for s in seqs:  # fill the cache by hand: this tests the decode alone
        for i in range(s.c.shape[0]):
            cache[s.table[i // B], i % B] = torch.cat([s.c[i], s.pe[i]])
    width = max(len(s.table) for s in seqs)
    tables = torch.tensor([s.table + [0] * (width - len(s.table)) for s in seqs])
    q = torch.stack([s.q[-1] for s in seqs])
    out = absorbed_decode(q, cache, tables, torch.tensor(lengths), w, DIMS, SCALE)
    for i, (s, n) in enumerate(zip(seqs, lengths, strict=True)):
        torch.testing.assert_close(out[i].double(), reference(s, w, n - 1, 1)[0], atol=1e-5,
                                   rtol=1e-5)  # fmt: skip


def test_prefill_writes_the_latent_rows() -> None:
    w, cache, seqs = setup(0, [5, 9])
    items = [(s, 0, s.q.shape[0]) for s in seqs]
    outs, md = run_step(w, cache, items)
    assert md.num_prefills == 2
    check(w, outs, items)
    for s in seqs:
        for i in range(s.c.shape[0]):
            assert torch.equal(cache[s.table[i // B], i % B], torch.cat([s.c[i], s.pe[i]]))


def test_chunks_with_context_then_decodes_in_one_batch() -> None:
    """A chunked prefill (context 6, not block aligned), a prefix hit (context 8), a fresh
    prefill and decodes in one step, then a decode step reading the previous one's rows."""
    w, cache, seqs = setup(1, [11, 11, 7, 6, 3])
    outs, _ = run_step(w, cache, [(seqs[0], 0, 6), (seqs[1], 0, 8), (seqs[3], 0, 5),
                                  (seqs[4], 0, 2)])  # fmt: skip
    mixed = [(seqs[0], 6, 5), (seqs[1], 8, 3), (seqs[2], 0, 7), (seqs[3], 5, 1), (seqs[4], 2, 1)]
    outs, md = run_step(w, cache, mixed)
    assert md.num_prefills == 3 and md.num_decode_tokens == 2
    check(w, outs, mixed)
    more = [(seqs[0], 10, 1), (seqs[1], 10, 1)]
    check(w, run_step(w, cache, more)[0], more)


def test_pad_slots_go_to_the_trash_block() -> None:
    w, cache, seqs = setup(2, [3])
    md = build_md([(seqs[0], 0, 3)])
    md.slot_mapping = torch.tensor([PAD_SLOT_ID, *md.slot_mapping[1:].tolist()])
    before = cache.clone()
    MLAImpl(DIMS, SCALE).forward(*step_inputs([(seqs[0], 0, 3)]), w, cache, md)
    first = seqs[0].table[0]
    assert torch.equal(cache[first, 0], before[first, 0])  # not written
    assert torch.equal(cache[-1, -1], torch.cat([seqs[0].c[0], seqs[0].pe[0]]))
    assert torch.equal(cache[:first], before[:first])


def test_layer_without_context_or_metadata_is_one_causal_sequence() -> None:
    w, _, seqs = setup(3, [9])
    s = seqs[0]
    config = EngineConfig()
    layer = MLAAttention(DIMS, SCALE, prefix="model.layers.0.self_attn.attn", config=config)
    want = reference(s, w, 0, 9).reshape(9, -1)
    inputs = (s.q.flatten(1), s.c, s.pe, w)
    torch.testing.assert_close(layer(*inputs).double(), want, atol=1e-5, rtol=1e-5)
    with set_forward_context(None, config, num_tokens=9):  # the engine's profiling pass
        torch.testing.assert_close(layer(*inputs).double(), want, atol=1e-5, rtol=1e-5)


def test_layer_reads_its_cache_and_metadata_from_the_forward_context() -> None:
    w, cache, seqs = setup(4, [6, 4])
    config = EngineConfig()
    name = "model.layers.2.self_attn.attn"
    layer = MLAAttention(DIMS, SCALE, prefix=name, config=config)
    layer.kv_cache = [cache]
    items = [(seqs[0], 0, 6), (seqs[1], 0, 4)]
    with set_forward_context({name: build_md(items)}, config, num_tokens=10):
        out = layer(*step_inputs(items), w)
    check(w, list(out.view(-1, DIMS.num_heads, DIMS.v_head_dim).split([6, 4])), items)
    assert torch.equal(cache[seqs[1].table[0], 3], torch.cat([seqs[1].c[3], seqs[1].pe[3]]))
