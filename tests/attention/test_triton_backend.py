"""The `triton` attention backend on CPU: its PyTorch decode path, prefill and cache writes.

On CPU the backend runs `paged_decode_reference` where a GPU runs the Triton kernel (which
`test_triton_kernel.py` compares with it under Triton's interpreter). The reference here is
dense attention in float64 over each sequence's own K/V (never read back from the cache), with
an explicit mask: query at position p sees key j iff j <= p (and j > p - window). Block tables
come from a shuffled permutation and the cache starts with finite garbage, so reading an
unwritten or masked slot shows up.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tests.attention._metadata_oracle import ListMetadataBuilder
from tokenwise.attention.backends import selector
from tokenwise.attention.backends.torch_backend import paged_decode_reference, write_kv_cache
from tokenwise.attention.backends.triton_backend import (
    TritonAttentionBackend,
    TritonAttentionImpl,
)
from tokenwise.attention.graph_state import CommonAttentionState
from tokenwise.attention.metadata import AttentionMetadata
from tokenwise.attention.utils import PAD_SLOT_ID

H, KVH, D, B = 8, 2, 16, 4
SCALE = D**-0.5
NUM_BLOCKS = 40


@dataclass
class Seq:
    seq_id: int
    q: torch.Tensor  # [L, H, D]
    k: torch.Tensor  # [L, KVH, D]
    v: torch.Tensor
    table: list[int]


def dense(seq: Seq, ctx: int, q_len: int, window: int | None = None) -> torch.Tensor:
    n = ctx + q_len
    group = seq.q.shape[1] // seq.k.shape[1]
    q = seq.q[ctx:n].double()
    k = seq.k[:n].double().repeat_interleave(group, dim=1)
    v = seq.v[:n].double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * seq.q.shape[2] ** -0.5
    q_pos = torch.arange(ctx, n)[:, None]
    k_pos = torch.arange(n)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)


def make_seqs(lengths: list[int], gen: torch.Generator, block: int = B) -> list[Seq]:
    perm = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    seqs = []
    for i, n in enumerate(lengths):
        nb = -(-n // block)
        table, perm = perm[:nb], perm[nb:]
        q, k, v = (torch.randn(n, h, D, generator=gen) for h in (H, KVH, KVH))
        seqs.append(Seq(i, q, k, v, table))
    return seqs


def new_cache(gen: torch.Generator, block: int = B) -> torch.Tensor:
    shape = TritonAttentionBackend.get_kv_cache_shape(NUM_BLOCKS, block, KVH, D)
    return torch.randn(shape, generator=gen) * 10


def step(
    impl: TritonAttentionImpl,
    cache: torch.Tensor,
    items: list[tuple[Seq, int, int]],
    window: int | None = None,
) -> tuple[list[torch.Tensor], AttentionMetadata]:
    builder = ListMetadataBuilder(B, window)
    for seq, ctx, ql in items:
        builder.add_sequence(seq.seq_id, ctx, ql, seq.table)
    md = builder.build([c + q for _, c, q in items], [q for _, _, q in items])

    def cat(name: str) -> torch.Tensor:
        return torch.cat([getattr(s, name)[c : c + q] for s, c, q in items]).flatten(1)

    out = impl.forward(cat("q"), cat("k"), cat("v"), cache, md)
    return list(out.view(-1, H, D).split([q for _, _, q in items])), md


def check(outs: list[torch.Tensor], items: list[tuple[Seq, int, int]], window: int | None = None):
    for out, (seq, ctx, ql) in zip(outs, items, strict=True):
        torch.testing.assert_close(out.double(), dense(seq, ctx, ql, window), atol=1e-5, rtol=1e-5)


def test_cache_shape_has_a_trash_block_and_the_backend_can_be_captured() -> None:
    assert TritonAttentionBackend.get_kv_cache_shape(10, 16, 2, 64) == (2, 11, 16, 2, 64)
    assert TritonAttentionBackend.supports_full_cudagraph


@pytest.mark.parametrize("window", [None, 5])
def test_prefill_chunk_and_decode_against_dense_attention(window: int | None) -> None:
    gen = torch.Generator().manual_seed(0)
    impl = TritonAttentionImpl(H, D, SCALE, KVH, sliding_window=window)
    cache = new_cache(gen)
    seqs = make_seqs([9, 13, 14, 6, 3], gen)
    first = [(seqs[1], 0, 6), (seqs[2], 0, 13), (seqs[3], 0, 5)]
    outs, _ = step(impl, cache, first, window)
    check(outs, first, window)
    # A fresh prompt, a chunk after 6 cached tokens (lower-right causal), and three decodes,
    # one of them a one-token prompt.
    mixed = [(seqs[0], 0, 9), (seqs[1], 6, 7), (seqs[2], 13, 1), (seqs[3], 5, 1), (seqs[4], 0, 1)]
    outs, md = step(impl, cache, mixed, window)
    assert (md.num_prefills, md.num_decode_tokens) == (2, 3)
    check(outs, mixed, window)
    for s, n in ((seqs[0], 9), (seqs[1], 13)):  # every token's K/V is in its slot
        for i in range(n):
            assert torch.equal(cache[0, s.table[i // B], i % B], s.k[i])
            assert torch.equal(cache[1, s.table[i // B], i % B], s.v[i])


def test_write_kv_sends_pad_slots_to_the_trash_block_only() -> None:
    gen = torch.Generator().manual_seed(1)
    cache = new_cache(gen)
    before = cache.clone()
    k, v = torch.randn(4, KVH, D, generator=gen), torch.randn(4, KVH, D, generator=gen)
    write_kv_cache(k, v, cache[0], cache[1], torch.tensor([6, PAD_SLOT_ID, 9 * B + 2, PAD_SLOT_ID]))
    assert torch.equal(cache[0, 1, 2], k[0]) and torch.equal(cache[1, 9, 2], v[2])
    keep = torch.ones(NUM_BLOCKS + 1, B, dtype=torch.bool)
    keep[1, 2] = keep[9, 2] = False
    keep[NUM_BLOCKS] = False
    assert torch.equal(cache[:, keep], before[:, keep])
    trash_keys = cache[0, NUM_BLOCKS, B - 1]
    assert torch.equal(trash_keys, k[1]) or torch.equal(trash_keys, k[3])


@pytest.mark.parametrize(
    ("block", "lengths", "window"),
    [(4, [1, 4, 5, 17, 30], None), (16, [3, 16, 40], None), (8, [2, 9, 33], 7), (4, [20, 7], 5)],
)
def test_reference_decode_against_dense_attention(
    block: int, lengths: list[int], window: int | None
) -> None:
    gen = torch.Generator().manual_seed(block + len(lengths))
    cache = new_cache(gen, block)
    seqs = make_seqs(lengths, gen, block)
    for s in seqs:
        slots = torch.tensor([s.table[i // block] * block + i % block for i in range(len(s.k))])
        write_kv_cache(s.k, s.v, cache[0], cache[1], slots)
    width = max(len(s.table) for s in seqs)
    tables = torch.tensor([s.table + [0] * (width - len(s.table)) for s in seqs], dtype=torch.int32)
    lens = torch.tensor(lengths, dtype=torch.int32)
    q = torch.stack([s.q[-1] for s in seqs])
    out = paged_decode_reference(q, cache[0], cache[1], tables, lens, SCALE, window)
    for i, s in enumerate(seqs):
        expected = dense(s, len(s.k) - 1, 1, window)[0]
        torch.testing.assert_close(out[i].double(), expected, atol=1e-5, rtol=1e-5)
    if window is not None:  # trimmed tables: drop the leading blocks and say where rows start
        first = [max(0, n - window) // block for n in lengths]
        trimmed = torch.zeros_like(tables)
        for i, (s, f) in enumerate(zip(seqs, first, strict=True)):
            trimmed[i, : len(s.table) - f] = torch.tensor(s.table[f:])
        starts = torch.tensor(first, dtype=torch.int32)
        again = paged_decode_reference(q, cache[0], cache[1], trimmed, lens, SCALE, window, starts)
        torch.testing.assert_close(again, out)


def test_graph_decode_reads_only_device_tensors() -> None:
    """A captured decode must not depend on host lists: replay happens with the capture-time
    metadata, whose lists describe padding rows. Poison them and the answer must not change."""
    gen = torch.Generator().manual_seed(2)
    impl = TritonAttentionImpl(H, D, SCALE, KVH)
    cache = new_cache(gen)
    seqs = make_seqs([14, 6, 9], gen)
    step(impl, cache, [(seqs[0], 0, 13), (seqs[1], 0, 5), (seqs[2], 0, 8)])
    state = CommonAttentionState(max_batch_size=4, max_blocks_per_seq=4, block_size=B)
    with state.graph_capture(4):
        capture_md = state.graph_capture_get_metadata_for_batch(4)
    builder = ListMetadataBuilder(B)
    for s, ctx in ((seqs[0], 13), (seqs[1], 5), (seqs[2], 8)):
        builder.add_sequence(s.seq_id, ctx, 1, s.table)
    real = builder.build([14, 6, 9], [1, 1, 1], cuda_graph_pad_size=1, batch_size=4)
    state.prepare_graph_input_buffers(state.get_graph_input_buffers(capture_md), real)
    capture_md.query_lens = [7] * 4
    capture_md.context_lens = [999] * 4
    capture_md.block_table_first_block = [3] * 4
    capture_md.seq_lens = [1] * 4
    pad = torch.randn(1, H, D, generator=gen)
    q = torch.cat([seqs[0].q[13:14], seqs[1].q[5:6], seqs[2].q[8:9], pad])
    k = torch.cat([seqs[0].k[13:14], seqs[1].k[5:6], seqs[2].k[8:9], torch.randn(1, KVH, D)])
    v = torch.cat([seqs[0].v[13:14], seqs[1].v[5:6], seqs[2].v[8:9], torch.randn(1, KVH, D)])
    out = impl.forward(q.flatten(1), k.flatten(1), v.flatten(1), cache, capture_md)
    out = out.view(4, H, D)
    check([out[0:1], out[1:2], out[2:3]], [(seqs[0], 13, 1), (seqs[1], 5, 1), (seqs[2], 8, 1)])


def test_selector(monkeypatch: pytest.MonkeyPatch) -> None:
    from tokenwise.attention.backends.torch_backend import TorchAttentionBackend
    from tokenwise.config import EngineConfig

    monkeypatch.delenv(selector.ENV_VAR, raising=False)
    assert selector.get_attn_backend(EngineConfig(device="cpu")) is TorchAttentionBackend
    assert selector.get_attn_backend(None) is TorchAttentionBackend
    monkeypatch.setattr(selector, "triton_available", lambda: True)
    assert selector.get_attn_backend(EngineConfig(device="cuda")) is TritonAttentionBackend
    assert selector.get_attn_backend(EngineConfig(device="cpu")) is TorchAttentionBackend
    monkeypatch.setattr(selector, "triton_available", lambda: False)
    assert selector.get_attn_backend(EngineConfig(device="cuda:0")) is TorchAttentionBackend
    monkeypatch.setenv(selector.ENV_VAR, "Triton")
    assert selector.get_attn_backend(EngineConfig(device="cpu")) is TritonAttentionBackend
    monkeypatch.setenv(selector.ENV_VAR, "flash")
    with pytest.raises(ValueError, match="torch, triton"):
        selector.get_attn_backend(EngineConfig())
