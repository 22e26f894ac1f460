"""Encoder-only attention: every token sees its whole sequence and nothing else, no cache.

The reference is written out here (softmax over explicit scores, one sequence at a time); both
formulations of the backend (per-sequence SDPA, the CPU path, and the padded masked call used
on GPUs) must equal it, also with one-token sequences and grouped KV heads.
"""

from __future__ import annotations

import pytest
import torch

from tokenwise.attention.backends.encoder_only import (
    attend_within_sequences,
    encoder_only_attention,
)
from tokenwise.attention.backends.torch_backend import TorchAttentionImpl
from tokenwise.attention.layer import Attention
from tokenwise.attention.metadata import AttentionMetadata
from tokenwise.attention.utils import AttentionType


def reference(q, k, v, lens, heads, kv_heads, head, scale):
    out, start = [], 0
    for n in lens:
        qs = q[start : start + n].view(n, heads, head).transpose(0, 1)
        ks = k[start : start + n].view(n, kv_heads, head).transpose(0, 1)
        vs = v[start : start + n].view(n, kv_heads, head).transpose(0, 1)
        ks = ks.repeat_interleave(heads // kv_heads, 0)
        vs = vs.repeat_interleave(heads // kv_heads, 0)
        probs = torch.softmax(qs @ ks.transpose(1, 2) * scale, dim=-1)
        out.append((probs @ vs).transpose(0, 1).reshape(n, heads * head))
        start += n
    return torch.cat(out)


def metadata(lens: list[int], context: list[int] | None = None) -> AttentionMetadata:
    n = sum(lens)
    return AttentionMetadata.for_sequences(
        lens,
        context or [0] * len(lens),
        torch.full((n,), -1, dtype=torch.int64),
        torch.zeros((len(lens), 0), dtype=torch.int32),
    )


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2)])
def test_matches_per_sequence_full_attention(packed: bool, heads: int, kv_heads: int) -> None:
    torch.manual_seed(0)
    lens, head = [5, 1, 9, 3], 8
    n = sum(lens)
    q = torch.randn(n, heads * head)
    k, v = torch.randn(2, n, kv_heads * head)
    scale = head**-0.5
    got = encoder_only_attention(
        q,
        k,
        v,
        metadata(lens),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_size=head,
        scale=scale,
        packed=packed,
    )
    torch.testing.assert_close(got, reference(q, k, v, lens, heads, kv_heads, head, scale))
    # Not causal: the first token of a sequence depends on the last one.
    k2 = k.clone()
    k2[4] += 1.0
    again = encoder_only_attention(
        q,
        k2,
        v,
        metadata(lens),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_size=head,
        scale=scale,
        packed=packed,
    )
    assert not torch.allclose(again[0], got[0])
    assert torch.equal(again[5:], got[5:])  # ...and no other sequence does


def test_without_metadata_all_tokens_are_one_bidirectional_sequence() -> None:
    torch.manual_seed(1)
    q, k, v = torch.randn(3, 6, 16)
    layer = Attention(2, 8, 0.3, attn_type=AttentionType.ENCODER_ONLY)
    assert not layer.needs_kv_cache
    expected = reference(q, k, v, [6], 2, 2, 8, 0.3)
    torch.testing.assert_close(layer(q, k, v), expected)  # no forward context
    impl = TorchAttentionImpl(2, 8, 0.3, 2, attn_type=AttentionType.ENCODER_ONLY)
    torch.testing.assert_close(impl.forward(q, k, v, torch.tensor([]), None), expected)


def test_chunked_prompts_and_unsupported_types_are_refused() -> None:
    q = torch.randn(4, 8)
    with pytest.raises(ValueError, match="context lengths"):
        encoder_only_attention(
            q, q, q, metadata([4], [3]), num_heads=1, num_kv_heads=1, head_size=8, scale=1.0
        )
    with pytest.raises(ValueError, match="'cross'"):
        Attention(2, 8, 0.3, attn_type="cross")
    with pytest.raises(ValueError, match="encoder_decoder attention is not causal"):
        Attention(2, 8, 0.3, sliding_window=4, attn_type=AttentionType.ENCODER_DECODER)
    with pytest.raises(ValueError, match="sliding window"):
        Attention(2, 8, 0.3, sliding_window=4, attn_type=AttentionType.ENCODER_ONLY)


def test_causal_packed_attention_equals_per_sequence() -> None:
    """The GPU's one padded call with the causal mask equals one causal call per sequence."""
    gen = torch.Generator().manual_seed(0)
    lens = [3, 7, 1, 5]
    q, k, v = (torch.randn(sum(lens), 4 * 8, generator=gen) for _ in range(3))
    settings = {"num_heads": 4, "num_kv_heads": 4, "head_size": 8, "scale": 8**-0.5}
    results = {}
    for causal in (True, False):
        packed = attend_within_sequences(q, k, v, lens, True, causal, **settings)
        single = attend_within_sequences(q, k, v, lens, False, causal, **settings)
        torch.testing.assert_close(packed, single, atol=1e-5, rtol=0)
        results[causal] = single
    # Causal: a sequence's first token sees only itself, so its output is its own value; its
    # last token sees the whole sequence, as bidirectional attention does.
    torch.testing.assert_close(results[True][3], v[3], atol=1e-6, rtol=0)
    torch.testing.assert_close(results[True][9], results[False][9], atol=1e-6, rtol=0)
    assert not torch.allclose(results[True][3], results[False][3], atol=1e-3)
