"""Bidirectional attention within an image (Gemma 3) in both prefill paths of the torch
backend, against a dense reference of HF's rule: (k <= q OR same image) AND k > q - window.

Rows cover a fresh prompt with an image, a chunk that starts inside an image whose first
tokens are cached (a prefix hit ending mid-image), a plain prefill beside them and a decode:
the decode and the plain prefill stay causal.
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
    reference,
    run_step,
)
from tokenwise.attention.backends.torch_backend import TorchAttentionImpl


def reference_with_images(
    seq: Seq,
    ctx: int,
    q_len: int,
    spans: list[tuple[int, int]],
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    n = ctx + q_len
    q = seq.q[ctx:n].double()
    k = seq.k[:n].double().repeat_interleave(H // KVH, dim=1)
    v = seq.v[:n].double().repeat_interleave(H // KVH, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * SCALE
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    q_pos = torch.arange(ctx, n)[:, None]
    k_pos = torch.arange(n)[None, :]
    allowed = k_pos <= q_pos
    for s, e in spans:
        allowed |= (q_pos >= s) & (q_pos < e) & (k_pos >= s) & (k_pos < e)
    if window is not None:
        allowed &= k_pos > q_pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("softcap", [None, 1.0], ids=["plain", "softcap"])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("prefill", ["per_sequence", "packed"])
def test_image_tokens_attend_both_ways(
    prefill: str, window: int | None, softcap: float | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    gen = torch.Generator().manual_seed(3)
    impl = TorchAttentionImpl(H, D, SCALE, KVH, sliding_window=window, logits_soft_cap=softcap)
    if prefill == "packed":
        monkeypatch.setattr(impl, "_prefill", impl._prefill_packed)
    cache = new_cache(gen)
    seqs = make_seqs([14, 16, 9, 7], gen)
    builder = ListMetadataBuilder(B, window)
    # Cache the first 6 tokens of seq 1 and 6 of seq 3 (K/V do not depend on the mask here).
    run_step(impl, cache, [(seqs[1], 0, 6), (seqs[3], 0, 6)], builder)
    items = [(seqs[0], 0, 14), (seqs[1], 6, 10), (seqs[2], 0, 9), (seqs[3], 6, 1)]
    spans = [[(3, 9)], [(4, 12), (13, 16)], []]
    builder.prepare()
    for seq, ctx, ql in items:
        builder.add_sequence(seq.seq_id, ctx, ql, seq.table)
    md = builder.build([c + q for _, c, q in items], [q for _, _, q in items])
    md.bidirectional_spans = spans
    q, k, v = (
        torch.cat([getattr(s, name)[c : c + n] for s, c, n in items]).flatten(1)
        for name in ("q", "k", "v")
    )
    out = impl.forward(q, k, v, cache, md).view(-1, H, D)
    outs = out.split([n for _, _, n in items])
    for i, (got, (seq, ctx, ql)) in enumerate(zip(outs, items, strict=True)):
        row_spans = spans[i] if i < len(spans) else []
        want = reference_with_images(seq, ctx, ql, row_spans, window, softcap)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    # The spans changed the image rows (a causal result would miss them by far).
    causal = reference(seqs[0], 0, 14, window, softcap)
    assert (outs[0].double() - causal).abs().max() > 1e-2
