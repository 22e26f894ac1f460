"""Attention sinks (gpt-oss) in the torch backend's prefill paths and mixed steps, against a
dense reference: one logit per head appended to every row's scores, softmaxed, then dropped.

One step holds a fresh prompt, a chunk after cached context, and a decode row (the C kernel's
`paged_decode` in a mixed step); both prefill paths (per sequence on CPU, packed on GPUs) are
run, with and without a window. The no-context path (a model used on its own) is checked too.
"""

from __future__ import annotations

import pytest
import torch

from tests.attention._metadata_oracle import ListMetadataBuilder
from tests.attention.test_torch_backend import (
    KVH,
    SCALE,
    B,
    D,
    H,
    Seq,
    make_seqs,
    new_cache,
    run_step,
)
from tokenwise.attention.backends.single_sequence import single_sequence_attention
from tokenwise.attention.backends.torch_backend import TorchAttentionImpl

SINKS = torch.linspace(-1.0, 3.0, H)


def reference_with_sinks(seq: Seq, ctx: int, q_len: int, window: int | None) -> torch.Tensor:
    n = ctx + q_len
    q = seq.q[ctx:n].double()
    k = seq.k[:n].double().repeat_interleave(H // KVH, dim=1)
    v = seq.v[:n].double().repeat_interleave(H // KVH, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * SCALE
    q_pos, k_pos = torch.arange(ctx, n)[:, None], torch.arange(n)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    sink = SINKS.double()[:, None, None].expand(H, q_len, 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", probs, v)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("prefill", ["per_sequence", "packed"])
def test_sinks_in_prefill_and_decode_rows(
    prefill: str, window: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    gen = torch.Generator().manual_seed(5)
    impl = TorchAttentionImpl(H, D, SCALE, KVH, sliding_window=window)
    impl.sinks = SINKS
    if prefill == "packed":
        monkeypatch.setattr(impl, "_prefill", impl._prefill_packed)
    cache = new_cache(gen)
    seqs = make_seqs([14, 16, 9], gen)
    builder = ListMetadataBuilder(B, window)
    run_step(impl, cache, [(seqs[1], 0, 6), (seqs[2], 0, 8)], builder)
    items = [(seqs[0], 0, 14), (seqs[1], 6, 10), (seqs[2], 8, 1)]
    builder.prepare()
    for seq, ctx, ql in items:
        builder.add_sequence(seq.seq_id, ctx, ql, seq.table)
    md = builder.build([c + q for _, c, q in items], [q for _, _, q in items])
    q, k, v = (
        torch.cat([getattr(s, name)[c : c + n] for s, c, n in items]).flatten(1)
        for name in ("q", "k", "v")
    )
    out = impl.forward(q, k, v, cache, md).view(-1, H, D)
    for got, (seq, ctx, ql) in zip(out.split([n for _, _, n in items]), items, strict=True):
        torch.testing.assert_close(
            got.double(), reference_with_sinks(seq, ctx, ql, window), atol=1e-5, rtol=1e-5
        )


@pytest.mark.parametrize("window", [None, 5])
def test_sinks_without_a_forward_context(window: int | None) -> None:
    seq = make_seqs([12], torch.Generator().manual_seed(6))[0]
    out = single_sequence_attention(
        seq.q.flatten(1), seq.k.flatten(1), seq.v.flatten(1), num_heads=H, num_kv_heads=KVH,
        head_size=D, scale=SCALE, sliding_window=window, sinks=SINKS,
    )  # fmt: skip
    want = reference_with_sinks(seq, 0, 12, window)
    torch.testing.assert_close(out.view(12, H, D).double(), want, atol=1e-5, rtol=1e-5)


def test_attention_refuses_sinks_it_cannot_use() -> None:
    from tokenwise.attention.layer import Attention
    from tokenwise.attention.utils import AttentionType

    with pytest.raises(ValueError, match=r"one logit per head, shape \(4,\)"):
        Attention(4, 16, 0.25, num_kv_heads=2, sinks=torch.zeros(2))
    with pytest.raises(ValueError, match="encoder_only attention takes no sinks"):
        Attention(4, 16, 0.25, attn_type=AttentionType.ENCODER_ONLY, sinks=torch.zeros(4))
