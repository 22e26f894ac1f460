"""The cross KV cache: written once per request (in the step its encoder runs), read through
the request's cross block table in every later step, never in the prefix cache, freed with the
request; and the helpers of `attention.utils` (forward-context.md §3) read the encoder / cross
fields the runner sets on the metadata.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

from tests.engine._fixtures import assert_pool_clean
from tests.tiny_checkpoints import build_tiny_checkpoint
from tokenwise.attention.backends.cross_attention import EncoderDecoderAttentionImpl
from tokenwise.attention.utils import (
    AttentionType,
    get_num_prefill_decode_query_kv_tokens,
    get_seq_len_block_table_args,
    is_all_cross_attn_metadata_set,
    is_all_encoder_attn_metadata_set,
)
from tokenwise.engine.block_manager import BlockManager
from tokenwise.entrypoints.llm import LLM
from tokenwise.sampling.params import SamplingParams

ENCODER_LENS = [3, 17, 33, 8]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One batch through the engine, with the metadata every cross/encoder call received."""
    path = build_tiny_checkpoint(tmp_path_factory.mktemp("bart"), "BartForConditionalGeneration")
    calls: list[tuple[str, Any, int]] = []
    original = EncoderDecoderAttentionImpl.forward

    def spy(self: Any, query: Any, key: Any, value: Any, kv_cache: Any, md: Any) -> Any:
        calls.append((self.attn_type, md, key.shape[0]))
        return original(self, query, key, value, kv_cache, md)

    EncoderDecoderAttentionImpl.forward = spy  # type: ignore[method-assign]
    try:
        llm = LLM(path, dtype="float32", num_gpu_blocks=64, block_size=8)
        prompts = [{"encoder_prompt": list(range(5, 5 + n))} for n in ENCODER_LENS]
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        EncoderDecoderAttentionImpl.forward = original  # type: ignore[method-assign]
    return {"llm": llm, "calls": calls, "outs": outs}


def test_encoder_runs_and_cross_kv_is_written_once_per_request(recorded: dict[str, Any]) -> None:
    llm = recorded["llm"]
    # Both decoder layers see the same per-step metadata; look at the first one's calls.
    cross = [(md, n) for kind, md, n in recorded["calls"] if kind is AttentionType.ENCODER_DECODER]
    per_layer = cross[::2]
    assert len(per_layer) >= 10  # one per step: the encoder step and at least 9 decode steps
    written = [md.num_encoder_tokens for md, _ in per_layer]
    assert sum(written) == sum(ENCODER_LENS)  # every encoder token's K/V written exactly once
    assert written[0] == sum(ENCODER_LENS) and not any(written[1:])  # all in the first step
    for md, num_keys in per_layer[1:]:
        assert num_keys == 0 and md.cross_slot_mapping.numel() == 0
        assert md.encoder_seq_lens == ENCODER_LENS  # every decode step still reads all of them
    slots = per_layer[0][0].cross_slot_mapping.tolist()
    assert len(set(slots)) == len(slots) and min(slots) >= 0
    assert llm.llm_engine.runner.kind_part.num_encoder_runs == len(ENCODER_LENS)
    assert all(len(o.outputs[0].token_ids) == 10 for o in recorded["outs"])
    assert_pool_clean(llm.llm_engine)


def test_seed_helpers_read_the_runner_metadata(recorded: dict[str, Any]) -> None:
    calls = recorded["calls"]
    enc_md = next(md for kind, md, _ in calls if kind is AttentionType.ENCODER)
    assert is_all_encoder_attn_metadata_set(enc_md)
    total = sum(ENCODER_LENS)
    assert get_num_prefill_decode_query_kv_tokens(enc_md, AttentionType.ENCODER) == (
        total,
        total,
        0,
    )
    lens, longest, tables = get_seq_len_block_table_args(enc_md, True, AttentionType.ENCODER)
    assert lens.tolist() == ENCODER_LENS and longest == max(ENCODER_LENS) and tables is None

    md = next(md for kind, md, _ in calls if kind is AttentionType.ENCODER_DECODER)
    assert is_all_cross_attn_metadata_set(md)
    # First step: four one-token decoder prompts (decodes in the split), all encoders run.
    assert get_num_prefill_decode_query_kv_tokens(md, AttentionType.ENCODER_DECODER) == (
        0,
        total,
        4,
    )
    lens, longest, tables = get_seq_len_block_table_args(md, False, AttentionType.ENCODER_DECODER)
    assert lens.tolist() == ENCODER_LENS and longest == max(ENCODER_LENS)
    assert tables is md.cross_block_tables
    # Each request's slots lie in its own cross blocks, in order, 8 tokens per block.
    slots = md.cross_slot_mapping.tolist()
    start = 0
    for row, n in enumerate(ENCODER_LENS):
        table = tables[row].tolist()
        assert slots[start : start + n] == [table[i // 8] * 8 + i % 8 for i in range(n)]
        start += n
    cross_blocks = {b for row, n in enumerate(ENCODER_LENS) for b in tables[row, : -(-n // 8)]}
    self_blocks = set(md.block_tables.flatten().tolist())
    assert not cross_blocks & self_blocks  # the two caches never share a block id


def test_cross_blocks_are_never_cached_and_free_with_the_request() -> None:
    bm = BlockManager(num_blocks=6, block_size=4, num_kv_cache_groups=2)
    tokens = list(range(8))
    assert bm.allocate_slots("a", tokens, 0, 8) is not None  # two full blocks, registered
    cross = bm.allocate_cross_slots("a", 9)
    assert cross is not None and len(cross) == 3
    assert all(bm.pool.blocks[b].block_hash is None for b in cross)
    assert bm.allocate_cross_slots("b", 5) is None  # 2 needed, 1 free: nothing taken
    assert bm.get_num_free_blocks() == 1
    bm.check_invariants()
    bm.free("a")  # both tables
    assert bm.get_num_free_blocks() == 6 and bm.num_cross_tables == 0
    assert Counter(bm.get_ref_count(b) for b in range(6)) == Counter({0: 6})
    bm.check_invariants()
    with pytest.raises(ValueError, match="already holds"):
        bm.allocate_cross_slots("c", 1)
        bm.allocate_cross_slots("c", 1)


def test_attention_without_engine_attends_to_all_encoder_tokens() -> None:
    """Used on its own (no forward context, no metadata), cross-attention sees every key."""
    impl = EncoderDecoderAttentionImpl(2, 4, 0.5, 1, AttentionType.ENCODER_DECODER)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, d, generator=g) for n, d in ((3, 8), (5, 4), (5, 4)))
    out = impl.forward(q, k, v, torch.empty(0), None)
    qh = q.view(3, 2, 4).transpose(0, 1)
    probs = torch.softmax(qh @ k.T * 0.5, dim=-1)  # both heads share the one KV head
    assert torch.allclose(out, (probs @ v).transpose(0, 1).reshape(3, 8), atol=1e-6)
