"""Speculative verification keeps the target distribution exactly, and greedy stays greedy.

The statistical tests draw thousands of verifications in one batched call on a 5-token
vocabulary and compare the emitted tokens' frequencies with the target distribution by a
chi-square test at the 0.1% level; `test_a_planted_bug_is_caught` shows the same test failing
when the residual distribution forgets to remove the draft's mass.
"""

from __future__ import annotations

import math

import pytest
import torch

from tokenwise.sampling import rejection
from tokenwise.sampling.metadata import SamplingMetadata, make_generator
from tokenwise.sampling.params import SamplingParams
from tokenwise.sampling.sampler import apply_top_k_top_p

V = 5
N = 12_000


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Upper 0.1% point of chi-square(df), by the Wilson-Hilferty approximation."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of `counts` against `probs` (cells with p > 0) and its df."""
    keep = probs > 0
    expected = probs[keep] * counts.sum()
    stat = float(((counts[keep] - expected) ** 2 / expected).sum())
    return stat, int(keep.sum()) - 1


def target(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a plain (non-speculative) draw uses, computed independently."""
    scaled = logits / params.temperature
    if params.top_k > 0:
        scaled = apply_top_k_top_p(scaled[None], torch.tensor([params.top_k]), None)[0]
    return torch.softmax(scaled, dim=-1)


def run(
    row_logits: torch.Tensor,
    drafts: list[int],
    params: SamplingParams,
    draft_probs: torch.Tensor | None = None,
    n: int = N,
) -> list[list[int]]:
    """`n` requests with the same drafts and rows (len(drafts) + 1 rows each)."""
    logits = row_logits.repeat(n, 1)
    per_request = len(drafts) + 1
    rows = n * per_request
    generators: list[torch.Generator | None] = [None] * rows
    if params.seed is not None:  # each request its own generator, shared by its rows
        own = [make_generator(params.seed + i) for i in range(n)]
        generators = [own[i // per_request] for i in range(rows)]
    metadata = SamplingMetadata.from_params([params] * rows, generators, vocab_size=V)
    probs = None if draft_probs is None else draft_probs.repeat(n, 1)
    return rejection.verify(logits, [list(drafts)] * n, metadata, probs).token_ids


LOGITS = torch.tensor(
    [[2.0, 1.0, 0.5, -1.0, 0.0], [0.0, 1.5, -0.5, 1.0, 0.2], [1.0, 1.0, 1.0, 0.0, -2.0]]
)


@pytest.mark.parametrize(
    ("drafts", "params"),
    [
        ([0, 1], SamplingParams(temperature=1.0)),  # the likeliest token drafted first
        ([3, 1], SamplingParams(temperature=1.0)),  # an unlikely draft, mostly rejected
        ([4, 4], SamplingParams(temperature=0.7, top_k=3)),  # a draft top-k removes
        ([2, 3], SamplingParams(temperature=1.3, seed=7)),  # seeded rows, own generator
    ],
)
def test_emitted_tokens_follow_the_target(drafts: list[int], params: SamplingParams) -> None:
    torch.manual_seed(0)
    out = run(LOGITS, drafts, params)
    p0, p1 = target(LOGITS[0], params), target(LOGITS[1], params)
    first = torch.bincount(torch.tensor([t[0] for t in out]), minlength=V).float()
    stat, df = chi2(first, p0)
    assert stat < chi2_critical(df), (stat, first, p0)
    # Given the first draft was accepted, the next token follows the row seen after it.
    second = [t[1] for t in out if len(t) > 1]
    assert abs(len(second) / N - float(p0[drafts[0]])) < 0.03
    if len(second) > 500:
        counts = torch.bincount(torch.tensor(second), minlength=V).float()
        stat, df = chi2(counts, p1)
        assert stat < chi2_critical(df), (stat, counts, p1)


def test_drafts_from_a_draft_distribution_keep_the_target() -> None:
    """A draft model's case: drafts drawn from q, accepted with min(1, p/q)."""
    torch.manual_seed(1)
    params = SamplingParams(temperature=1.0)
    q = torch.tensor([0.05, 0.15, 0.5, 0.2, 0.1])
    p0 = target(LOGITS[0], params)
    counts = torch.zeros(V)
    for draft in range(V):  # stratified: each draft token in proportion to q
        n = int(N * float(q[draft]))
        out = run(LOGITS[:2], [draft], params, q[None], n=n)
        counts += torch.bincount(torch.tensor([t[0] for t in out]), minlength=V).float()
    stat, df = chi2(counts, p0)
    assert stat < chi2_critical(df), (stat, counts, p0)


def test_a_planted_bug_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Drawing from the target instead of the residual after a rejection over-weights the
    draft token: the chi-square test must reject it."""
    monkeypatch.setattr(rejection, "_residual", lambda probs, *_: probs.clone())
    torch.manual_seed(0)
    params = SamplingParams(temperature=1.0)
    out = run(LOGITS, [1, 1], params)
    first = torch.bincount(torch.tensor([t[0] for t in out]), minlength=V).float()
    stat, df = chi2(first, target(LOGITS[0], params))
    assert stat > chi2_critical(df)


def test_greedy_keeps_drafts_while_they_are_the_argmax() -> None:
    # Row argmaxes: 0, 1, 0 (ties go to the first index), then the bonus row's 2.
    logits = torch.tensor(
        [
            [3.0, 1.0, 0.0, 0.0, 0.0],
            [0.0, 2.0, 1.0, 0.0, 0.0],
            [1.0, 1.0, 0.0, 0.0, 0.0],
            [0.0, 0.0, 5.0, 0.0, 0.0],
        ]
    )
    both = torch.cat([logits, logits])
    out = rejection.verify(both, [[0, 1, 0], [0, 4, 0]], None)
    assert out.token_ids == [[0, 1, 0, 2], [0, 1]]
    assert out.num_accepted == [3, 1]
    assert out.row_starts == [0, 4]


def test_logprob_rows_follow_the_emitted_tokens() -> None:
    params = SamplingParams(temperature=0.0, logprobs=2)
    metadata = SamplingMetadata.from_params([params] * 3, [None] * 3, vocab_size=V)
    out = rejection.verify(LOGITS.clone(), [[0, 3]], metadata)
    assert out.token_ids == [[0, 1]]  # draft 0 is row 0's argmax; row 1's argmax is 1, not 3
    assert out.logprobs is not None
    expected = torch.log_softmax(LOGITS, dim=-1)
    assert out.logprobs.token_ids[:2, 0].tolist() == [0, 1]
    assert torch.allclose(out.logprobs.logprobs[0, 0], expected[0, 0])
    assert torch.allclose(out.logprobs.logprobs[1, 0], expected[1, 1])


def test_row_count_must_match_the_drafts() -> None:
    with pytest.raises(ValueError, match="logit rows"):
        rejection.verify(LOGITS, [[0, 1, 2]], None)
