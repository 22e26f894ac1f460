"""Per-micro-batch attention metadata (forward-context.md §4): `split_attention_metadata`, dicts.

The field tests work every expectation out by hand from one scenario (block size 4,
`slot = table[pos // 4] * 4 + pos % 4`). The equivalence tests are the point: running a batch
through `TorchAttentionImpl` once must give the same output and the same cache as running its
micro-batches one after another, each writing its K/V before the next one reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.attention._metadata_oracle import ListMetadataBuilder
from tokenwise.attention.backends.torch_backend import TorchAttentionBackend, TorchAttentionImpl
from tokenwise.attention.metadata import AttentionMetadata
from tokenwise.attention.ubatch_metadata import split_attention_metadata, split_metadata_by_layer
from tokenwise.distributed.ubatching import UBatchSlice, create_ubatch_slices
from tokenwise.native import paged_decode as cpu_paged_decode

H, KVH, D, B = 4, 2, 16, 4  # GQA: 2 query heads per KV head
SCALE = D**-0.5
NUM_BLOCKS = 64

# ---------------------------------------------------------------------------------------------
# Field level. The scenario (context, query, table), prefills first:
#   r0: prefill, ctx 3, q 7, table [3, 7, 10]: positions 3..9 -> 15 | 28 29 30 31 | 40 41
#   r1: prefill, ctx 0, q 5, table [2, 9]    : positions 0..4 -> 8 9 10 11 | 36
#   r2: decode,  ctx 4,      table [5, 1]    : position 4 -> 4
#   r3: decode,  ctx 9,      table [0, 6, 8] : position 9 -> 33
# Tokens 0..6 are r0's, 7..11 r1's, 12 r2's, 13 r3's.
# ---------------------------------------------------------------------------------------------
SLOTS = [15, 28, 29, 30, 31, 40, 41, 8, 9, 10, 11, 36, 4, 33]
TABLES = [[3, 7, 10], [2, 9, 0], [5, 1, 0], [0, 6, 8]]  # rows padded with 0 to 3 blocks


def scenario(window: int | None = None) -> AttentionMetadata:
    b = ListMetadataBuilder(block_size=B, sliding_window=window)
    b.add_sequence(0, context_len=3, query_len=7, block_table=[3, 7, 10])
    b.add_sequence(1, context_len=0, query_len=5, block_table=[2, 9])
    b.add_sequence(2, context_len=4, query_len=1, block_table=[5, 1])
    b.add_sequence(3, context_len=9, query_len=1, block_table=[0, 6, 8])
    return b.build(seq_lens=[10, 5, 5, 10], query_lens=[7, 5, 1, 1])


def ints(t: torch.Tensor | None) -> list[int]:
    assert t is not None and t.dtype == torch.int32
    return t.tolist()


def expect(
    md: AttentionMetadata,
    rows: list[int],
    query: list[int],
    ctx: list[int],
    num_prefills: int,
    slots: list[int],
) -> None:
    seq = [c + q for c, q in zip(ctx, query, strict=True)]
    assert md.num_seqs == len(rows)
    assert md.num_prefills == num_prefills
    assert md.num_prefill_tokens == sum(query[:num_prefills])
    assert md.num_decode_tokens == sum(query[num_prefills:])
    assert md.query_lens == query and md.context_lens == ctx and md.seq_lens == seq
    assert ints(md.seq_lens_tensor) == seq and ints(md.context_lens_tensor) == ctx
    qsl, ssl = [0], [0]
    for q, s in zip(query, seq, strict=True):
        qsl.append(qsl[-1] + q)
        ssl.append(ssl[-1] + s)
    assert ints(md.query_start_loc) == qsl and ints(md.seq_start_loc) == ssl
    assert md.slot_mapping.tolist() == slots
    assert md.block_tables.tolist() == [TABLES[r] for r in rows]
    assert md.max_query_len == max(query)
    assert md.max_prefill_seq_len == max(seq[:num_prefills], default=0)
    assert md.max_decode_seq_len == max(seq[num_prefills:], default=0)
    assert md.block_size == B and md.use_cuda_graph is False


# split point -> (rows, query, ctx, num_prefills, slots) of micro-batch 0, then micro-batch 1.
CASES = {
    "on_a_request_boundary": (
        7,
        ([0], [7], [3], 1, SLOTS[:7]),
        ([1, 2, 3], [5, 1, 1], [0, 4, 9], 1, SLOTS[7:]),
    ),
    "inside_the_first_prefill": (
        3,  # r0's positions 3..5 run first; 6..9 then see 6 tokens of context
        ([0], [3], [3], 1, [15, 28, 29]),
        ([0, 1, 2, 3], [4, 5, 1, 1], [6, 0, 4, 9], 2, SLOTS[3:]),
    ),
    "inside_the_second_prefill": (
        9,  # r1's positions 0..1 run first (fresh), 2..4 then see 2 tokens of context
        ([0, 1], [7, 2], [3, 0], 2, SLOTS[:9]),
        ([1, 2, 3], [3, 1, 1], [2, 4, 9], 1, [10, 11, 36, 4, 33]),
    ),
    "one_prefill_token_left_for_micro_batch_1": (
        11,  # r1's last token (position 4) is a one-token prefill part, still a prefill
        ([0, 1], [7, 4], [3, 0], 2, SLOTS[:11]),
        ([1, 2, 3], [1, 1, 1], [4, 4, 9], 1, [36, 4, 33]),
    ),
    "one_prefill_token_in_micro_batch_0": (
        1,  # r0's position 3 alone: a prefill of one token whose sequence ends at 4
        ([0], [1], [3], 1, [15]),
        ([0, 1, 2, 3], [6, 5, 1, 1], [4, 0, 4, 9], 2, SLOTS[1:]),
    ),
    "among_the_decodes": (
        13,
        ([0, 1, 2], [7, 5, 1], [3, 0, 4], 2, SLOTS[:13]),
        ([3], [1], [9], 0, [33]),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_split_fields(case: str) -> None:
    split, part0, part1 = CASES[case]
    md = scenario()
    ub0, ub1 = create_ubatch_slices(md.query_lens, split)
    expect(split_attention_metadata(md, ub0), *part0)
    expect(split_attention_metadata(md, ub1), *part1)


def test_split_keeps_window_first_blocks() -> None:
    """Windowed rows (window 4) start at block (ctx - 3) // 4: r0 0, r1 0, r2 0, r3 1."""
    md = scenario(window=4)
    assert md.block_table_first_block == [0, 0, 0, 1]
    ub0, ub1 = create_ubatch_slices(md.query_lens, 9)
    p0, p1 = split_attention_metadata(md, ub0), split_attention_metadata(md, ub1)
    assert p0.block_table_first_block == [0, 0] and p1.block_table_first_block == [0, 0, 1]
    assert p1.block_tables.tolist() == [[2, 9, 0], [5, 1, 0], [6, 8, 0]]
    assert p0.sliding_window == 4 and p1.sliding_window == 4
    assert p1.first_block_tensor.tolist() == [0, 0, 1]


def test_split_rejects_empty_and_out_of_range_slices() -> None:
    md = scenario()
    empty, _ = create_ubatch_slices(md.query_lens, 0)
    with pytest.raises(ValueError, match="empty"):
        split_attention_metadata(md, empty)
    with pytest.raises(ValueError, match="beyond the batch"):
        split_attention_metadata(md, UBatchSlice(slice(3, 5), slice(13, 16)))
    with pytest.raises(ValueError, match="beyond the batch"):
        split_attention_metadata(md, UBatchSlice(slice(0, 1), slice(-1, 3)))
    with pytest.raises(ValueError, match="the request slice does not match the token slice"):
        split_attention_metadata(md, UBatchSlice(slice(0, 1), slice(0, 9)))


def test_dict_form_keeps_sharing_and_none_stays_none() -> None:
    md, other = scenario(), scenario(window=4)
    ub0, ub1 = create_ubatch_slices(md.query_lens, 9)
    out = split_metadata_by_layer({"l0": md, "l1": md, "l2": other, "l3": md}, ub1)
    assert list(out) == ["l0", "l1", "l2", "l3"]
    assert out["l0"] is out["l1"] is out["l3"] and out["l2"] is not out["l0"]
    assert out["l0"] is not md and out["l0"].query_lens == [3, 1, 1]
    assert out["l0"].sliding_window is None and out["l2"].sliding_window == 4
    single = split_metadata_by_layer(md, ub0)
    assert isinstance(single, AttentionMetadata) and single.query_lens == [7, 2]
    assert split_metadata_by_layer(None, ub0) is None


# ---------------------------------------------------------------------------------------------
# Behaviour: whole batch vs micro-batches, through the torch backend.
# ---------------------------------------------------------------------------------------------


@contextmanager
def decode_path(impl: TorchAttentionImpl, path: str) -> Iterator[None]:
    """`cpu`: the default CPU path (C decode kernel when it builds); `fallback`: the PyTorch
    per-sequence decode; `gpu_formulation`: the packed prefill and batched decode that GPUs
    run, here on CPU tensors (they read `seq_lens_tensor` and the first blocks)."""
    original = cpu_paged_decode.load
    if path == "fallback":
        cpu_paged_decode.load = lambda: None  # type: ignore[assignment]
    elif path == "gpu_formulation":
        impl._prefill = impl._prefill_packed  # type: ignore[method-assign]
        impl._decode_cpu = lambda q, kc, vc, md, out: out.copy_(  # type: ignore[method-assign]
            impl._decode(q, kc, vc, md)
        )
    try:
        yield
    finally:
        cpu_paged_decode.load = original  # type: ignore[assignment]
        impl.__dict__.pop("_prefill", None)
        impl.__dict__.pop("_decode_cpu", None)


@st.composite
def batches(draw: Callable) -> tuple[list[tuple[int, int]], list[int]]:
    """(context, query) per request, prefills first, and 1-2 distinct interior split points."""
    prefills = draw(
        st.lists(st.tuples(st.integers(0, 10), st.integers(2, 9)), min_size=0, max_size=3)
    )
    decodes = draw(st.lists(st.integers(0, 12), min_size=0 if prefills else 2, max_size=3))
    reqs = prefills + [(c, 1) for c in decodes]
    total = sum(q for _, q in reqs)
    points = draw(st.lists(st.integers(1, total - 1), min_size=1, max_size=2, unique=True))
    return reqs, sorted(points)


def check_equivalence(
    reqs: list[tuple[int, int]], points: list[int], window: int | None, seed: int = 0
) -> None:
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(NUM_BLOCKS, generator=gen).tolist()  # non-contiguous tables
    builder = ListMetadataBuilder(B, window)
    for i, (ctx, q) in enumerate(reqs):
        nb = -(-(ctx + q) // B)
        table, perm = perm[:nb], perm[nb:]
        builder.add_sequence(i, ctx, q, table)
    md = builder.build([c + q for c, q in reqs], [q for _, q in reqs])
    n = md.num_prefill_tokens + md.num_decode_tokens
    q = torch.randn(n, H * D, generator=gen)
    k = torch.randn(n, KVH * D, generator=gen)
    v = torch.randn(n, KVH * D, generator=gen)
    # Random finite values everywhere: the context tokens' K/V, and garbage in slots that a
    # micro-batch must not read before the earlier micro-batch wrote them.
    cache0 = torch.randn(TorchAttentionBackend.get_kv_cache_shape(NUM_BLOCKS, B, KVH, D))
    slices = create_ubatch_slices(md.query_lens, points)
    impl = TorchAttentionImpl(H, D, SCALE, KVH, sliding_window=window)
    for path in ("cpu", "fallback", "gpu_formulation"):
        with decode_path(impl, path):
            full_cache = cache0.clone()
            full = impl.forward(q, k, v, full_cache, md)
            split_cache = cache0.clone()
            parts = []
            for ub in slices:
                t = ub.token_slice
                part_md = split_attention_metadata(md, ub)
                parts.append(impl.forward(q[t], k[t], v[t], split_cache, part_md))
        where = f"{path}: reqs={reqs} points={points} window={window}"
        assert torch.allclose(torch.cat(parts), full, atol=1e-5), where
        assert torch.equal(split_cache, full_cache), where


@settings(max_examples=40, deadline=None, derandomize=True)
@given(batches())
def test_micro_batches_match_the_whole_batch(
    batch: tuple[list[tuple[int, int]], list[int]],
) -> None:
    check_equivalence(*batch, window=None)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(batches(), st.sampled_from([1, 3, 5, 8]))
def test_micro_batches_match_the_whole_batch_with_sliding_window(
    batch: tuple[list[tuple[int, int]], list[int]], window: int
) -> None:
    check_equivalence(*batch, window=window)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("split", [1, 3, 7, 9, 11, 13])
def test_scenario_micro_batches_match_the_whole_batch(window: int | None, split: int) -> None:
    """The field-level scenario again, through the backend (fixed cases beside hypothesis)."""
    check_equivalence([(3, 7), (0, 5), (4, 1), (9, 1)], [split], window, seed=split)
