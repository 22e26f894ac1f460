"""The torch paged-attention backend against plain dense attention (forward-context.md §3, §5).

The reference rebuilds each sequence's full K/V from the test's own tensors (never from the
cache) and computes softmax(q k^T * scale + mask) v in float64 with an explicit mask: query at
position p sees key j iff j <= p (and j > p - window under a sliding window). Blocks are handed
out from a shuffled permutation so tables are non-contiguous, and the cache starts filled with
finite garbage so that reading any slot that was not written (or should be masked) shows up.
Every test runs twice on CPU decode: through the C kernel and through the PyTorch fallback.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tests.attention._metadata_oracle import ListMetadataBuilder
from tokenwise.attention.backends.torch_backend import (
    TorchAttentionBackend,
    TorchAttentionImpl,
    write_kv_cache,
)
from tokenwise.attention.graph_state import CommonAttentionState
from tokenwise.attention.metadata import AttentionMetadata
from tokenwise.attention.utils import PAD_SLOT_ID
from tokenwise.native import paged_decode as cpu_paged_decode

H, KVH, D, B = 8, 2, 16, 4  # GQA: 4 query heads per KV head
SCALE = D**-0.5
NUM_BLOCKS = 40


@pytest.fixture(autouse=True, params=["c_kernel", "torch_fallback"])
def decode_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs with the C decode kernel and again with the pure-PyTorch fallback."""
    if request.param == "torch_fallback":
        monkeypatch.setattr(cpu_paged_decode, "load", lambda: None)
    elif cpu_paged_decode.load() is None:
        pytest.skip("no C compiler: the kernel cannot be built here")
    return request.param


@dataclass
class Seq:
    seq_id: int
    q: torch.Tensor  # [L, H, D]   queries of every position
    k: torch.Tensor  # [L, KVH, D] keys of every position
    v: torch.Tensor
    table: list[int]


def reference(
    seq: Seq, ctx: int, q_len: int, window: int | None = None, softcap: float | None = None
) -> torch.Tensor:
    """Dense attention of positions ctx .. ctx+q_len-1 over keys 0 .. ctx+q_len-1."""
    n = ctx + q_len
    q = seq.q[ctx:n].double()
    k = seq.k[:n].double().repeat_interleave(H // KVH, dim=1)  # query head h -> kv head h//4
    v = seq.v[:n].double().repeat_interleave(H // KVH, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * SCALE
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    q_pos = torch.arange(ctx, n)[:, None]
    k_pos = torch.arange(n)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
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
                seq_id=i,
                q=torch.randn(n, H, D, generator=gen),
                k=torch.randn(n, KVH, D, generator=gen),
                v=torch.randn(n, KVH, D, generator=gen),
                table=table,
            )
        )
    return seqs


def new_cache(gen: torch.Generator, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    shape = TorchAttentionBackend.get_kv_cache_shape(NUM_BLOCKS, B, KVH, D)
    return (torch.randn(shape, generator=gen) * 10).to(dtype)


def run_step(
    impl: TorchAttentionImpl,
    cache: torch.Tensor,
    items: list[tuple[Seq, int, int]],
    builder: ListMetadataBuilder,
    dtype: torch.dtype = torch.float32,
) -> tuple[list[torch.Tensor], AttentionMetadata]:
    """One forward call over (seq, context_len, query_len) items (prefills first)."""
    builder.prepare()
    for seq, ctx, ql in items:
        builder.add_sequence(seq.seq_id, ctx, ql, seq.table)
    md = builder.build([c + q for _, c, q in items], [q for _, _, q in items])

    def cat(name: str, width: int) -> torch.Tensor:
        parts = [getattr(s, name)[c : c + q] for s, c, q in items]
        return torch.cat(parts).reshape(-1, width).to(dtype)

    out = impl.forward(cat("q", H * D), cat("k", KVH * D), cat("v", KVH * D), cache, md)
    assert out.shape == (sum(q for _, _, q in items), H * D) and out.dtype == dtype
    per_seq = list(out.view(-1, H, D).split([q for _, _, q in items]))
    return per_seq, md


def check(
    outs: list[torch.Tensor],
    items: list[tuple[Seq, int, int]],
    window: int | None = None,
    atol: float = 1e-5,
    rtol: float = 1e-5,
    softcap: float | None = None,
) -> None:
    for out, (seq, ctx, ql) in zip(outs, items, strict=True):
        torch.testing.assert_close(
            out.double(), reference(seq, ctx, ql, window, softcap), atol=atol, rtol=rtol
        )


def setup(
    seed: int, lengths: list[int], window: int | None = None, softcap: float | None = None
) -> tuple[TorchAttentionImpl, torch.Tensor, list[Seq], ListMetadataBuilder]:
    gen = torch.Generator().manual_seed(seed)
    impl = TorchAttentionImpl(H, D, SCALE, KVH, sliding_window=window, logits_soft_cap=softcap)
    return impl, new_cache(gen), make_seqs(lengths, gen), ListMetadataBuilder(B, window)


def test_kv_cache_shape_has_a_trash_block() -> None:
    assert TorchAttentionBackend.get_kv_cache_shape(10, 4, 2, 16) == (2, 11, 4, 2, 16)


def test_fresh_prefills_batched() -> None:
    impl, cache, seqs, builder = setup(0, [5, 9, 3, 12])
    items = [(s, 0, s.q.shape[0]) for s in seqs]
    outs, md = run_step(impl, cache, items, builder)
    assert md.num_prefills == 4
    check(outs, items)
    # Every token's K/V landed in its slot: slot of position i is table[i // B] * B + i % B.
    for s in seqs:
        for i in range(s.k.shape[0]):
            blk, off = s.table[i // B], i % B
            assert torch.equal(cache[0, blk, off], s.k[i])
            assert torch.equal(cache[1, blk, off], s.v[i])


def test_prefill_with_context() -> None:
    """Chunked prefill (context 6, not block aligned) and a prefix hit (context 8, aligned):
    the second call must equal bottom-right-aligned causal attention over the full sequence."""
    impl, cache, seqs, builder = setup(1, [11, 11, 14])
    first = [(seqs[0], 0, 6), (seqs[1], 0, 8), (seqs[2], 0, 3)]
    outs, _ = run_step(impl, cache, first, builder)
    check(outs, first)
    second = [(seqs[0], 6, 5), (seqs[1], 8, 3), (seqs[2], 3, 7)]
    outs, md = run_step(impl, cache, second, builder)
    assert md.num_prefills == 3 and md.num_decode_tokens == 0
    check(outs, second)
    third = [(seqs[2], 10, 4)]
    outs, _ = run_step(impl, cache, third, builder)
    check(outs, third)


def test_batched_decodes_of_different_lengths() -> None:
    lengths = [3, 8, 13, 5, 2]
    impl, cache, seqs, builder = setup(2, [n + 2 for n in lengths])
    prompt = [(s, 0, n) for s, n in zip(seqs, lengths, strict=True)]
    run_step(impl, cache, prompt, builder)
    for step in range(2):  # two decode steps; the second reads the first one's K/V
        items = [(s, n + step, 1) for s, n in zip(seqs, lengths, strict=True)]
        outs, md = run_step(impl, cache, items, builder)
        assert md.num_prefills == 0 and md.num_decode_tokens == len(seqs)
        check(outs, items)


def test_single_token_prompt_is_a_decode() -> None:
    impl, cache, seqs, builder = setup(3, [1, 4])
    items = [(seqs[0], 0, 1)]
    outs, md = run_step(impl, cache, items, builder)
    assert md.num_decode_tokens == 1 and md.num_prefills == 0
    check(outs, items)  # attends to itself only: equals its own v (per kv group)


def test_mixed_batch() -> None:
    impl, cache, seqs, builder = setup(4, [7, 9, 10, 4, 16])
    prep = [(seqs[1], 0, 5), (seqs[2], 0, 9), (seqs[3], 0, 3), (seqs[4], 0, 15)]
    run_step(impl, cache, prep, builder)
    items = [
        (seqs[0], 0, 7),  # fresh prefill
        (seqs[1], 5, 4),  # chunk with context
        (seqs[2], 9, 1),  # decodes
        (seqs[3], 3, 1),
        (seqs[4], 15, 1),
    ]
    outs, md = run_step(impl, cache, items, builder)
    assert (md.num_prefills, md.num_prefill_tokens, md.num_decode_tokens) == (2, 11, 3)
    check(outs, items)


def test_sliding_window() -> None:
    """Window 5 for fresh prefill, prefill with context, decode, alone and mixed."""
    w = 5
    impl, cache, seqs, builder = setup(5, [11, 12, 15, 14], window=w)
    fresh = [(seqs[0], 0, 11)]
    outs, _ = run_step(impl, cache, fresh, builder)
    check(outs, fresh, window=w)

    prep = [(seqs[1], 0, 7), (seqs[2], 0, 14), (seqs[3], 0, 13)]
    outs, _ = run_step(impl, cache, prep, builder)
    check(outs, prep, window=w)

    chunk = [(seqs[1], 7, 5)]  # first block (7-4)//4 = 0, window masks inside
    outs, _ = run_step(impl, cache, chunk, builder)
    check(outs, chunk, window=w)

    decode = [(seqs[2], 14, 1)]  # first block (14-4)//4 = 2: keys 8..14, 8 and 9 masked
    outs, md = run_step(impl, cache, decode, builder)
    assert md.block_table_first_block == [2]
    check(outs, decode, window=w)

    # Mixed: a chunk whose table is trimmed plus decodes with and without trimming.
    gen = torch.Generator().manual_seed(50)
    cache2 = new_cache(gen)
    s = make_seqs([16, 12, 14, 4], gen)
    run_step(impl, cache2, [(s[0], 0, 9), (s[1], 0, 11), (s[2], 0, 13), (s[3], 0, 3)], builder)
    items = [(s[0], 9, 7), (s[1], 11, 1), (s[2], 13, 1), (s[3], 3, 1)]
    outs, md = run_step(impl, cache2, items, builder)
    assert md.block_table_first_block == [1, 1, 2, 0]  # (context - 4) // 4, at least 0
    check(outs, items, window=w)


def test_pad_slots_only_touch_the_trash_block(decode_path: str) -> None:
    """Padding rows (a graph's) write no real block: the torch path sends them to the trash
    block, the C step (which CPU graphs replay) writes them nowhere."""
    gen = torch.Generator().manual_seed(6)
    impl = TorchAttentionImpl(H, D, SCALE, KVH)
    cache = new_cache(gen)
    seqs = make_seqs([6, 9], gen)
    builder = ListMetadataBuilder(B)
    run_step(impl, cache, [(seqs[0], 0, 5), (seqs[1], 0, 8)], builder)
    before = cache.clone()

    builder.prepare()
    builder.add_sequence(0, 5, 1, seqs[0].table)
    builder.add_sequence(1, 8, 1, seqs[1].table)
    md = builder.build([6, 9], [1, 1], cuda_graph_pad_size=2, batch_size=4)
    assert md.slot_mapping.tolist()[2:] == [PAD_SLOT_ID, PAD_SLOT_ID]
    pad_k = torch.randn(2, KVH, D, generator=gen)
    pad_v = torch.randn(2, KVH, D, generator=gen)
    q = torch.cat([seqs[0].q[5:6], seqs[1].q[8:9], torch.randn(2, H, D, generator=gen)])
    k = torch.cat([seqs[0].k[5:6], seqs[1].k[8:9], pad_k])
    v = torch.cat([seqs[0].v[5:6], seqs[1].v[8:9], pad_v])
    out = impl.forward(
        q.reshape(4, -1),
        k.reshape(4, -1),
        v.reshape(4, -1),
        cache,
        md,
    ).view(4, H, D)
    check([out[0:1], out[1:2]], [(seqs[0], 5, 1), (seqs[1], 8, 1)])
    assert torch.isfinite(out).all()

    # Real slots: position 5 of seq 0 and position 8 of seq 1.
    real = {(seqs[0].table[1], 1), (seqs[1].table[2], 0)}
    for blk in range(NUM_BLOCKS):
        for off in range(B):
            if (blk, off) not in real:
                assert torch.equal(cache[:, blk, off], before[:, blk, off]), (blk, off)
    assert torch.equal(cache[0, seqs[0].table[1], 1], seqs[0].k[5])
    assert torch.equal(cache[1, seqs[1].table[2], 0], seqs[1].v[8])
    if decode_path == "c_kernel":
        assert torch.equal(cache[:, NUM_BLOCKS], before[:, NUM_BLOCKS])
        return
    # The padding rows went to the trash block (the extra last block) and nowhere else.
    trash_k, trash_v = cache[0, NUM_BLOCKS], cache[1, NUM_BLOCKS]
    changed = [any(torch.equal(trash_k[o], pk) for pk in pad_k) for o in range(B)]
    assert any(changed)
    for o in range(B):
        if changed[o]:
            assert any(torch.equal(trash_v[o], pv) for pv in pad_v)
        else:
            assert torch.equal(cache[:, NUM_BLOCKS, o], before[:, NUM_BLOCKS, o])


def test_write_kv_cache_skips_pad_slots() -> None:
    gen = torch.Generator().manual_seed(7)
    cache = new_cache(gen)
    before = cache.clone()
    k = torch.randn(4, KVH, D, generator=gen)
    v = torch.randn(4, KVH, D, generator=gen)
    slots = torch.tensor([5, PAD_SLOT_ID, 7 * B + 3, PAD_SLOT_ID])
    write_kv_cache(k, v, cache[0], cache[1], slots)
    assert torch.equal(cache[0, 1, 1], k[0]) and torch.equal(cache[1, 1, 1], v[0])
    assert torch.equal(cache[0, 7, 3], k[2]) and torch.equal(cache[1, 7, 3], v[2])
    mask = torch.ones(NUM_BLOCKS + 1, B, dtype=torch.bool)
    mask[1, 1] = mask[7, 3] = False
    mask[NUM_BLOCKS] = False  # the trash block may change
    assert torch.equal(cache[:, mask], before[:, mask])


@pytest.mark.parametrize("window", [None, 5])
def test_graph_replay_reads_the_persistent_buffers(window: int | None) -> None:
    """Capture-time metadata, then the real batch copied into its buffers: the backend run on
    the capture metadata gives the real batch's answer (what a replayed graph computes). With
    a sliding window the capture metadata's host-side fields are frozen at capture time, so
    the real batch must not depend on per-step window trimming of its block tables."""
    impl, cache, seqs, builder_plain = setup(8, [14, 6], window=window)
    run_step(impl, cache, [(seqs[0], 0, 13), (seqs[1], 0, 5)], builder_plain)
    state = CommonAttentionState(max_batch_size=4, max_blocks_per_seq=4, block_size=B)
    with state.graph_capture(4):
        capture_md = state.graph_capture_get_metadata_for_batch(4)
        buffers = state.get_graph_input_buffers(capture_md)
    builder = ListMetadataBuilder(B, window)
    builder.add_sequence(0, 13, 1, seqs[0].table)
    builder.add_sequence(1, 5, 1, seqs[1].table)
    real_md = builder.build([14, 6], [1, 1], cuda_graph_pad_size=2, batch_size=4)
    state.prepare_graph_input_buffers(buffers, real_md)
    gen = torch.Generator().manual_seed(80)
    q = torch.cat([seqs[0].q[13:14], seqs[1].q[5:6], torch.randn(2, H, D, generator=gen)])
    k = torch.cat([seqs[0].k[13:14], seqs[1].k[5:6], torch.randn(2, KVH, D, generator=gen)])
    v = torch.cat([seqs[0].v[13:14], seqs[1].v[5:6], torch.randn(2, KVH, D, generator=gen)])
    out = impl.forward(
        q.reshape(4, -1),
        k.reshape(4, -1),
        v.reshape(4, -1),
        cache,
        capture_md,
    ).view(4, H, D)
    check([out[0:1], out[1:2]], [(seqs[0], 13, 1), (seqs[1], 5, 1)], window=window)


@pytest.mark.parametrize("window", [None, 5])
def test_bf16_close_to_fp32_reference(window: int | None) -> None:
    """bf16 keeps 8 significand bits (unit roundoff 2^-8 ~ 3.9e-3). Rounding q and k perturbs
    each logit (16-term dot product of N(0,1) values times 1/4) by ~1e-2 at most, which moves
    softmax weights by about that relative amount; rounding v and the output adds ~4e-3. With
    |v| ~ 1 the output error stays near 1e-2, so atol = rtol = 4e-2 leaves ~3x margin while
    still failing on any masking or indexing mistake (those change outputs by O(1))."""
    gen = torch.Generator().manual_seed(9)
    impl = TorchAttentionImpl(H, D, SCALE, KVH, sliding_window=window)
    cache = new_cache(gen, torch.bfloat16)
    seqs = make_seqs([9, 12, 14, 6], gen)
    builder = ListMetadataBuilder(B, window)
    prep = [(seqs[1], 0, 5), (seqs[2], 0, 13), (seqs[3], 0, 5)]
    run_step(impl, cache, prep, builder, torch.bfloat16)
    items = [(seqs[0], 0, 9), (seqs[1], 5, 7), (seqs[2], 13, 1), (seqs[3], 5, 1)]
    outs, _ = run_step(impl, cache, items, builder, torch.bfloat16)
    assert all(o.dtype == torch.bfloat16 for o in outs)
    check(outs, items, window=window, atol=4e-2, rtol=4e-2)


@pytest.mark.parametrize("window", [None, 3, 6])
def test_packed_prefill_equals_the_dense_reference(
    window: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU's one-call prefill (forced here on CPU): fresh prompts, then chunks after a
    cached context of different lengths, beside a decode, with and without a window."""
    impl, cache, seqs, builder = setup(7, [9, 14, 6, 11, 2], window)
    monkeypatch.setattr(impl, "_prefill", impl._prefill_packed)
    first = [(seqs[0], 0, 4), (seqs[1], 0, 9), (seqs[2], 0, 6), (seqs[3], 0, 2), (seqs[4], 0, 1)]
    outs, md = run_step(impl, cache, first, builder)
    assert md.num_prefills == 4
    check(outs, first, window)
    second = [(seqs[0], 4, 5), (seqs[1], 9, 5), (seqs[3], 2, 9), (seqs[4], 1, 1)]
    outs, md = run_step(impl, cache, second, builder)
    assert md.num_prefills == 3 and md.num_decode_tokens == 1
    check(outs, second, window)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("prefill", ["per_sequence", "packed"])
def test_soft_capped_scores_in_every_path(
    window: int | None, prefill: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gemma 2's logit soft-cap (cap * tanh(score / cap)) in fresh prefills, chunks after
    cached context, decodes (C kernel and fallback, by the fixture), the batched graph decode
    and the no-metadata single-sequence path. A cap of 1 bends these scores (~N(0, 1)) hard, so
    a path that skipped it would miss the reference by far more than the tolerance."""
    cap = 1.0
    impl, cache, seqs, builder = setup(11, [10, 14, 8], window, softcap=cap)
    if prefill == "packed":
        monkeypatch.setattr(impl, "_prefill", impl._prefill_packed)
    first = [(seqs[0], 0, 6), (seqs[1], 0, 13), (seqs[2], 0, 7)]
    outs, _ = run_step(impl, cache, first, builder)
    check(outs, first, window, softcap=cap)
    uncapped = reference(seqs[1], 0, 13, window)
    assert (outs[1].double() - uncapped).abs().max() > 1e-2
    second = [(seqs[0], 6, 4), (seqs[1], 13, 1), (seqs[2], 7, 1)]
    outs, md = run_step(impl, cache, second, builder)
    check(outs, second, window, softcap=cap)
    decodes = torch.cat([seqs[1].q[13:14], seqs[2].q[7:8]])
    batched = impl._decode(decodes, cache[0], cache[1], md)
    check(list(batched.split(1)), second[1:], window, softcap=cap)
    alone = impl.forward(
        seqs[0].q[:10].reshape(10, H * D),
        seqs[0].k[:10].reshape(10, KVH * D),
        seqs[0].v[:10].reshape(10, KVH * D),
        cache,
        None,
    )
    check([alone.view(10, H, D)], [(seqs[0], 0, 10)], window, softcap=cap)
