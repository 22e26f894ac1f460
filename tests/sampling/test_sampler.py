"""Sampler behaviour: greedy exactness, seeded reproducibility, support of each filter,
temperature statistics, logprobs, and penalties. Expected values come from numpy or by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenwise.sampling import Sampler, SamplingMetadata, SamplingParams, make_generator
from tokenwise.sampling.sampler import apply_penalties, apply_top_k_top_p

SAMPLER = Sampler()


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None] | None = None,
    **kwargs: object,
):
    meta = SamplingMetadata.from_params(
        params, generators or [None] * len(params), vocab_size=logits.shape[-1], **kwargs
    )
    return SAMPLER(logits, meta)


def np_softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def draws(row: torch.Tensor, params: SamplingParams, n: int) -> set[int]:
    """Distinct tokens seen over n draws of one row, done as one batched call."""
    out = sample(row.repeat(n, 1), [params] * n)
    return set(out.sampled_token_ids.tolist())


def test_all_greedy_returns_argmax() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    out = sample(logits, [SamplingParams(temperature=0.0)] * 6)
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.sampled_token_ids.tolist() == np.argmax(logits.numpy(), axis=1).tolist()
    assert out.logprobs is None


def test_mixed_batch_keeps_greedy_rows_exact() -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, 40)
    logits[1] = 0.0  # flat rows: random sampling must wander
    logits[3] = 0.0
    params = [SamplingParams(temperature=0.0), SamplingParams(), SamplingParams(temperature=0.0)]
    params.append(SamplingParams(temperature=1.5))
    seen_random: set[int] = set()
    for _ in range(30):
        tokens = sample(logits, params).sampled_token_ids.tolist()
        assert tokens[0] == int(np.argmax(logits[0].numpy()))
        assert tokens[2] == int(np.argmax(logits[2].numpy()))
        seen_random.update((tokens[1], tokens[3]))
    assert len(seen_random) > 5


def _step_logits(steps: int, vocab: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(123)
    return [torch.randn(vocab, generator=gen) * 0.5 for _ in range(steps)]


def _seeded_run(seed: int, row_logits: list[torch.Tensor], batched: bool) -> list[int]:
    gen = make_generator(seed)
    tokens = []
    if not batched:
        for logits in row_logits:
            out = sample(logits.unsqueeze(0), [SamplingParams(seed=seed)], [gen])
            tokens.append(int(out.sampled_token_ids[0]))
        return tokens
    torch.manual_seed(999)  # the unseeded rows' global stream must not matter
    others = [make_generator(7), make_generator(8)]
    params = [SamplingParams(temperature=t) for t in (1.0, 0.0, 0.3)]
    params += [SamplingParams(seed=seed), SamplingParams(seed=7), SamplingParams(top_k=3)]
    params += [SamplingParams(seed=8, top_p=0.5), SamplingParams(min_p=0.1)]
    gens: list[torch.Generator | None] = [None, None, None, gen, others[0], None, others[1], None]
    for logits in row_logits:
        batch = torch.randn(8, logits.shape[0])
        batch[3] = logits
        tokens.append(int(sample(batch, params, gens).sampled_token_ids[3]))
    return tokens


def test_seeded_row_reproduces_alone_or_in_a_batch() -> None:
    row_logits = _step_logits(20, 100)
    alone = _seeded_run(42, row_logits, batched=False)
    assert _seeded_run(42, row_logits, batched=True) == alone
    assert len(set(alone)) > 1  # the generator advances: fresh noise every step
    assert _seeded_run(43, row_logits, batched=False) != alone


def test_seeded_row_without_generator_is_rejected() -> None:
    with pytest.raises(ValueError, match="generator"):
        SamplingMetadata.from_params([SamplingParams(seed=1)], [None])


ROW = torch.randn(30, generator=torch.Generator().manual_seed(5))


def test_top_k_yields_only_k_largest() -> None:
    torch.manual_seed(2)
    got = draws(ROW, SamplingParams(top_k=5, temperature=3.0), 2000)
    expected = set(np.argsort(-ROW.numpy())[:5].tolist())
    assert got == expected


def _nucleus(probs: np.ndarray, top_p: float) -> set[int]:
    order = np.argsort(-probs)
    cumulative = np.cumsum(probs[order])
    size = int(np.searchsorted(cumulative, top_p) + 1)
    assert np.min(np.abs(cumulative - top_p)) > 1e-4  # keep the test off a float boundary
    return set(order[:size].tolist())


def test_top_p_yields_only_nucleus() -> None:
    torch.manual_seed(3)
    got = draws(ROW, SamplingParams(top_p=0.6), 2000)
    expected = _nucleus(np_softmax(ROW.numpy().astype(np.float64)), 0.6)
    assert 1 < len(expected) < 30
    assert got == expected  # every member has >= 4% mass, so 2000 draws reach all of them


def test_min_p_yields_only_tokens_above_threshold() -> None:
    torch.manual_seed(4)
    got = draws(ROW, SamplingParams(min_p=0.2), 2000)
    probs = np_softmax(ROW.numpy().astype(np.float64))
    expected = set(np.nonzero(probs >= 0.2 * probs.max())[0].tolist())
    assert 1 < len(expected) < 30
    assert got == expected


def test_top_k_top_p_min_p_combined() -> None:
    torch.manual_seed(5)
    temperature, min_p, top_k, top_p = 2.0, 0.1, 8, 0.7
    got = draws(
        ROW, SamplingParams(temperature=temperature, min_p=min_p, top_k=top_k, top_p=top_p), 4000
    )
    probs = np_softmax(ROW.numpy().astype(np.float64) / temperature)
    keep = probs >= min_p * probs.max()
    keep &= np.isin(np.arange(30), np.argsort(-probs)[:top_k])
    renormalised = np.where(keep, probs, 0.0) / probs[keep].sum()
    expected = _nucleus(renormalised, top_p)
    assert 1 < len(expected) < keep.sum()  # every filter actually bites
    assert got == expected  # every member has >= 10% mass after renormalising


def test_filters_are_per_row() -> None:
    torch.manual_seed(6)
    logits = torch.zeros(2, 20)
    logits[:, :10] = torch.linspace(1.0, 0.0, 10)
    params = [SamplingParams(top_k=2), SamplingParams(top_k=-1)]
    out = sample(logits.repeat(500, 1), params * 500).sampled_token_ids.view(500, 2)
    assert set(out[:, 0].tolist()) == {0, 1}
    assert len(set(out[:, 1].tolist())) > 10


def test_top_p_one_never_trims_a_peaked_tail() -> None:
    logits = torch.full((2, 50), -10.0)
    logits[:, 0] = 20.0  # cumulative float32 mass hits 1.0 right after token 0
    out = apply_top_k_top_p(logits, torch.tensor([50, 60]), torch.tensor([1.0, 0.5]))
    assert torch.isfinite(out[0]).all()  # top_p=1 and k >= vocab: nothing removed
    assert torch.isfinite(out[1]).sum() == 1  # top_p=0.5: only the peak survives


def test_temperature_matches_softmax_frequencies() -> None:
    torch.manual_seed(7)
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0])
    n = 20000
    out = sample(logits.repeat(n, 1), [SamplingParams(temperature=0.5)] * n)
    freq = np.bincount(out.sampled_token_ids.numpy(), minlength=5) / n
    expected = np_softmax(logits.numpy().astype(np.float64) / 0.5)
    assert np.abs(freq - expected).max() < 0.02


def test_logprobs_come_from_raw_logits() -> None:
    torch.manual_seed(8)
    logits = torch.randn(4, 25)
    params = [
        SamplingParams(temperature=0.0, logprobs=1),
        SamplingParams(temperature=0.5, logprobs=3),
        SamplingParams(repetition_penalty=2.0),
        SamplingParams(top_k=4, logprobs=0),
    ]
    out = sample(logits, params, output_token_ids=[[1], [2], [3], [4]])
    assert out.logprobs is not None
    lp = out.logprobs
    assert lp.token_ids.shape == (4, 4) and lp.logprobs.shape == (4, 4)
    sampled = out.sampled_token_ids
    assert torch.equal(lp.token_ids[:, 0], sampled)
    reference = torch.log_softmax(logits.double(), dim=-1)
    assert torch.allclose(
        lp.logprobs[:, 0].double(), reference[torch.arange(4), sampled], atol=1e-5
    )
    top_values, top_ids = torch.topk(reference, 3, dim=-1)
    assert torch.equal(lp.token_ids[:, 1:], top_ids)
    assert torch.allclose(lp.logprobs[:, 1:].double(), top_values, atol=1e-5)
    ref = reference.numpy()
    expected_ranks = [1 + int((ref[i] > ref[i, t]).sum()) for i, t in enumerate(sampled.tolist())]
    assert lp.ranks.tolist() == expected_ranks
    assert lp.ranks[0] == 1  # greedy row


def test_repetition_penalty_arithmetic_and_greedy_flip() -> None:
    logits = torch.tensor([[3.0, 2.5, -1.0, 0.0]])
    meta = SamplingMetadata.from_params(
        [SamplingParams(temperature=0.0, repetition_penalty=1.5)],
        [None],
        output_token_ids=[[0]],
        prompt_token_ids=[[2, 2]],
    )
    penalised = apply_penalties(logits, meta)
    assert torch.allclose(penalised, torch.tensor([[2.0, 2.5, -1.5, 0.0]]))
    assert sample(logits, [SamplingParams(temperature=0.0)]).sampled_token_ids.item() == 0
    assert SAMPLER(logits, meta).sampled_token_ids.item() == 1
    # A token seen only in the prompt is penalised too.
    prompt_only = sample(
        logits,
        [SamplingParams(temperature=0.0, repetition_penalty=1.5)],
        output_token_ids=[[]],
        prompt_token_ids=[[0]],
    )
    assert prompt_only.sampled_token_ids.item() == 1


def test_presence_and_frequency_penalties_by_hand() -> None:
    logits = torch.zeros(2, 5)
    meta = SamplingMetadata.from_params(
        [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), SamplingParams()],
        [None, None],
        output_token_ids=[[1, 1, 3], [0, 2]],
        prompt_token_ids=[[4], [4]],
    )
    penalised = apply_penalties(logits, meta)
    # token 1: 0.5 + 2 * 0.25; token 3: 0.5 + 0.25; prompt token 4 untouched; row 1 neutral.
    expected = torch.tensor([[0.0, -1.0, 0.0, -0.75, 0.0], [0.0] * 5])
    assert torch.allclose(penalised, expected)


def test_frequency_penalty_flips_greedy_away_from_repeats() -> None:
    logits = torch.tensor([[1.0, 0.8, 0.0]])
    params = [SamplingParams(temperature=0.0, frequency_penalty=0.15)]
    once = sample(logits, params, output_token_ids=[[0]]).sampled_token_ids.item()
    twice = sample(logits, params, output_token_ids=[[0, 0]]).sampled_token_ids.item()
    assert (once, twice) == (0, 1)  # 1.0 - 0.15 > 0.8 but 1.0 - 0.30 < 0.8


def test_plain_greedy_fast_path_equals_the_full_sampler() -> None:
    """`Sampler.greedy` (no metadata) picks what `forward` picks for plain greedy rows, ties
    included; rows with logprobs, penalties or a temperature are not plain greedy."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 300, generator=gen)
    logits[2, 10] = logits[2, 250] = logits[2].max() + 1  # a tie: the first index wins
    params = [SamplingParams(temperature=0.0) for _ in range(5)]
    assert Sampler.is_plain_greedy(params)
    md = SamplingMetadata.from_params(params, [None] * 5, vocab_size=300)
    full = Sampler()(logits.clone(), md)
    fast = Sampler.greedy(logits.clone())
    assert torch.equal(fast.sampled_token_ids, full.sampled_token_ids)
    assert fast.logprobs is None and int(fast.sampled_token_ids[2]) == 10
    for other in (
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=0.0, repetition_penalty=1.2),
        SamplingParams(temperature=0.0, presence_penalty=0.5),
        SamplingParams(temperature=0.0, frequency_penalty=0.5),
    ):
        assert not Sampler.is_plain_greedy([*params, other])
