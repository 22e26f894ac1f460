"""KV-cache specs, groups and their managers: several groups over one pool.

The hybrid rules: layers with equal specs form groups that share tensors when their pages are
interchangeable; a sliding-window group frees the blocks that left its window while the request
runs (and those blocks serve other groups at once); a prefix hit is the longest one every group
can serve; the pool is clean after every request ends. Engine-level parity with HF under
sliding windows is in tests/models/test_gemma_vs_hf.py.
"""

from __future__ import annotations

import pytest

from tests.engine._fixtures import assert_pool_clean, checkpoint
from tokenwise import LLM, SamplingParams
from tokenwise.engine.block_manager import BlockManager
from tokenwise.kv_cache.layout import MAX_GROUPS, make_layout
from tokenwise.kv_cache.managers import NULL_BLOCK
from tokenwise.kv_cache.specs import (
    CrossAttentionSpec,
    FullAttentionSpec,
    SlidingWindowSpec,
)

BS = 16
PAGE = 1024
KV = ((2, 1, BS, 1, 8), (2, 2, BS, 1, 8), "torch.float32")


def full(page: int = PAGE, storage: tuple = KV) -> FullAttentionSpec:
    return FullAttentionSpec(BS, page, storage)


def sliding(window: int, page: int = PAGE, storage: tuple = KV) -> SlidingWindowSpec:
    return SlidingWindowSpec(BS, page, storage, window)


# ------------------------------------------------------------------------ layout


def test_gemma3_shape_shares_six_tensors_between_six_groups() -> None:
    """30 sliding + 6 global layers (5:1): six groups of six layers, six tensors, each used by
    one layer of every group; a block id costs six pages, not 36."""
    specs = {f"l{i}": full() if i % 6 == 5 else sliding(512) for i in range(36)}
    layout = make_layout(specs)
    assert [g.spec.kind for g in layout.groups] == ["full"] + ["sliding_window"] * 5
    assert all(len(g.layer_names) == 6 for g in layout.groups)
    assert layout.groups[0].layer_names == tuple(f"l{i}" for i in range(5, 36, 6))
    assert len(layout.tensors) == 6 and layout.shared
    assert layout.bytes_per_block == 6 * PAGE
    for tensor in layout.tensors:  # one layer of each group per tensor
        assert sorted(layout.group_of(n) for n in tensor.shared_by) == list(range(6))


def test_many_groups_grow_the_group_size_instead() -> None:
    """1 global + 30 sliding layers would make 31 one-layer groups; the size grows until at
    most MAX_GROUPS groups remain (the global group is then partly empty)."""
    specs = {"g": full(), **{f"s{i}": sliding(64) for i in range(30)}}
    layout = make_layout(specs)
    assert len(layout.groups) <= MAX_GROUPS
    size = len(layout.tensors)
    assert all(len(g.layer_names) <= size for g in layout.groups)
    assert sum(len(g.layer_names) for g in layout.groups) == 31


def test_pages_that_differ_keep_a_tensor_per_layer() -> None:
    """Global layers with bigger heads: no sharing, every layer its own tensor, still two
    groups (the sliding one frees blocks for the other)."""
    big = ((2, 1, BS, 2, 8), (2, 2, BS, 2, 8), "torch.float32")
    specs = {"a": sliding(32), "b": full(2 * PAGE, big), "c": sliding(32)}
    layout = make_layout(specs)
    assert not layout.shared
    assert [g.spec.kind for g in layout.groups] == ["full", "sliding_window"]
    assert layout.bytes_per_block == 4 * PAGE
    assert {layout.tensor_of(n) for n in specs} == {0, 1, 2}


def test_one_kind_is_one_group_and_cross_attention_comes_last() -> None:
    cross = CrossAttentionSpec(BS, PAGE, KV)
    layout = make_layout({"self0": full(), "cross0": cross, "self1": full(), "cross1": cross})
    assert [g.spec.kind for g in layout.groups] == ["full", "cross"]
    assert layout.groups[0].layer_names == ("self0", "self1")
    assert len(layout.tensors) == 4 and layout.bytes_per_block == 4 * PAGE


def test_without_hybrid_grouping_windows_keep_every_block() -> None:
    """Pipeline stages lay out their own layers: sliding layers then group as full attention,
    so a stage holding only sliding layers still sees the driver's one group."""
    stage0 = make_layout({"l0": full(), "l1": sliding(32)}, hybrid=False)
    stage1 = make_layout({"l2": sliding(32), "l3": sliding(32)}, hybrid=False)
    assert stage0.specs == stage1.specs == (full(),)
    assert make_layout({"l0": full(), "l1": sliding(32)}).specs == (full(), sliding(32))


# ------------------------------------------------------------------------ managers


def hybrid(num_blocks: int, window: int = 32) -> BlockManager:
    return BlockManager(num_blocks, BS, specs=[full(), sliding(window)])


def run_request(bm: BlockManager, rid: str, tokens: list[int], chunk: int, decode: int) -> list:
    """Admit `tokens` with prefix lookup, prefill in chunks, then decode `decode` tokens;
    the blocks each group holds after every step."""
    hits, computed = bm.get_computed_blocks(rid, tokens)
    held = []
    first = True
    while computed < len(tokens):
        n = min(chunk, len(tokens) - computed)
        if first:
            assert bm.allocate_slots(rid, tokens, 0, n, hits) is not None
            computed, first = computed + n, False
        else:
            assert bm.allocate_slots(rid, tokens, computed, n) is not None
            computed += n
        held.append([m.num_held(rid) for m in bm.managers])
    for i in range(decode):
        tokens = tokens + [1000 + i]
        assert bm.allocate_slots(rid, tokens, computed, 1) is not None
        computed += 1
        held.append([m.num_held(rid) for m in bm.managers])
    bm.check_invariants()
    return held


def test_sliding_group_holds_a_window_of_blocks_while_decoding() -> None:
    """Window 32 = 2 blocks: the sliding group never holds more than window/block + 1 blocks in
    a decode step, while the full group grows with the sequence."""
    bm = hybrid(200)
    held = run_request(bm, "a", list(range(300)), chunk=64, decode=70)
    decode = held[-70:]
    assert max(h[1] for h in decode) <= 32 // BS + 1
    assert decode[-1][0] == -(-370 // BS)
    # Prefill chunks hold the chunk plus the window behind it.
    assert max(h[1] for h in held[:-70]) <= -(-(31 + 64) // BS) + 1
    bm.free("a")
    assert bm.get_num_free_blocks() == 200
    bm.check_invariants()


def test_blocks_a_window_frees_serve_the_full_group_of_another_request() -> None:
    """A pool too small for two sequences under one-kind accounting fits both: what the
    window of the first frees, the second allocates."""
    bm = hybrid(60, window=16)
    run_request(bm, "a", list(range(400)), chunk=400, decode=0)  # 25 full + 25 sliding
    assert bm.get_num_free_blocks() == 10
    assert bm.allocate_slots("a", list(range(401)), 400, 1) is not None  # window step frees
    assert bm.num_held_blocks("a") == 26 + 2
    run_request(bm, "b", list(range(500, 800)), chunk=32, decode=0)
    bm.free("a")
    bm.free("b")
    assert bm.get_num_free_blocks() == 60
    bm.check_invariants()


def test_prefix_hit_keeps_only_the_window_in_the_sliding_group() -> None:
    bm = hybrid(100, window=32)
    prompt = list(range(160))  # 10 blocks
    run_request(bm, "a", prompt, chunk=160, decode=0)
    bm.free("a")  # every block free but cached
    hits, num_hit = bm.get_computed_blocks("b", prompt + [7])
    assert num_hit == 160
    assert len(hits[0]) == 10 and NULL_BLOCK not in hits[0]
    # A query at position 160 sees 129..160: only blocks 8 and 9 of the sliding group.
    assert hits[1][:8] == [NULL_BLOCK] * 8 and NULL_BLOCK not in hits[1][8:]
    assert bm.allocate_slots("b", prompt + [7], 0, 1, hits) is not None
    assert bm.num_held_blocks("b") == 11 + 3
    bm.free("b")
    bm.check_invariants()


def test_a_hit_shrinks_until_every_group_can_serve_it() -> None:
    """The full group could serve all ten blocks of the prefix, but the sliding group lost
    block 8 (evicted): a hit of 10 would need its blocks 8 and 9, so the agreed hit is the
    longest the sliding group can serve, 8 blocks (its blocks 6 and 7 are cached)."""
    bm = hybrid(100, window=32)
    prompt = list(range(160))
    run_request(bm, "a", prompt, chunk=16, decode=0)  # sliding blocks 0..6 freed, cached
    sliding_table = bm.get_block_table("a", 1)
    assert sliding_table[:7] == (NULL_BLOCK,) * 7
    bm.free("a")
    bm.pool.uncache(sliding_table[8])  # as an eviction would
    hits, num_hit = bm.get_computed_blocks("b", prompt + [1])
    assert num_hit == 8 * BS
    assert len(hits[0]) == 8 and NULL_BLOCK not in hits[0]
    # Blocks 6 and 7 were freed by the window while "a" ran (its table says NULL there) but
    # stayed cached: the hit revives them.
    assert hits[1][:6] == [NULL_BLOCK] * 6 and sliding_table[7] == hits[1][7]
    assert hits[1][6] not in (NULL_BLOCK, *hits[0], *sliding_table)
    # Block 6 evicted too: the longest hit whose last two sliding blocks are cached ends
    # after block 5 (blocks 4 and 5, freed by the window early on, are still cached).
    bm.pool.uncache(hits[1][6])
    assert bm.get_computed_blocks("c", prompt + [1])[1] == 6 * BS
    bm.free("b")
    bm.free("c")
    bm.check_invariants()


def test_admission_counts_every_group() -> None:
    """`max_blocks_per_request` sums the groups, and an allocation must fit in all of them."""
    bm = hybrid(10, window=32)
    assert bm.max_blocks_per_request(160, 16) == 10 + 4
    assert bm.allocate_slots("a", list(range(100)), 0, 100) is None  # 7 full + 7 sliding
    assert bm.get_num_free_blocks() == 10
    assert bm.allocate_slots("a", list(range(100)), 0, 32) == ([0, 1], [2, 3])
    assert bm.get_num_free_blocks() == 6
    bm.free("a")
    bm.check_invariants()


# ------------------------------------------------------------------------ engine


def test_engine_frees_window_blocks_of_a_long_request() -> None:
    """A tiny Gemma 3 (window 8, block 16) generating past 200 tokens: while it decodes, no
    sliding group holds more than window/block + 1 blocks; every block is free at the end."""
    llm = LLM(
        checkpoint("Gemma3ForCausalLM"),
        dtype="float32",
        num_gpu_blocks=80,
        max_model_len=256,
        block_size=16,
    )
    engine = llm.llm_engine
    bm = engine.block_manager
    sliding = [m for m in bm.managers if m.spec.kind == "sliding_window"]
    assert sliding and all(m.spec.sliding_window == 8 for m in sliding)
    engine.add_request("r", {"prompt_token_ids": list(range(3, 150))}, GREEDY_LONG)
    most = 0
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        if steps > 2:  # decode steps (the prompt took one chunk)
            most = max(most, *(m.num_held("r") for m in sliding))
    assert steps > 60
    assert most <= 8 // 16 + 1 + 1  # a window of 8 tokens spans at most 2 blocks of 16
    assert_pool_clean(engine)


GREEDY_LONG = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


@pytest.mark.parametrize("num_gpu_blocks", [10])
def test_pool_too_small_for_one_sequence_names_every_group(num_gpu_blocks: int) -> None:
    with pytest.raises(ValueError, match="give it at least"):
        LLM(
            checkpoint("Gemma3ForCausalLM"),
            dtype="float32",
            num_gpu_blocks=num_gpu_blocks,
            max_model_len=192,
            max_num_batched_tokens=16,
        )
