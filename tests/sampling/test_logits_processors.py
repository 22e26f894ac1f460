"""logit_bias, allowed_token_ids and bad_words through the engine, with and without drafts.

Expected tokens come from Hugging Face: the same rule applied to transformers' fp32 logits
(argmax over the allowed tokens, argmax without a banned one), or from the unbiased greedy
output the processor must change. With speculative decoding, an oracle proposer drafts either
the processed output (drafts accepted) or the unprocessed one (drafts the processor forbids,
which must be rejected, including a bad word's last token drafted right after its first), and
the output must equal decoding without drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import Any

import numpy as np
import pytest
import torch

from tests.engine._fixtures import LLAMA, NUM_BLOCKS, checkpoint, hf_greedy, hf_model, mixed_prompts
from tests.engine._fixtures import tokenizer as tiny_tokenizer
from tokenwise import LLM, SamplingParams
from tokenwise.sampling.logits_processors import apply_logits_processors

MAX_TOKENS = 16
K = 3


@pytest.fixture(scope="module")
def llama() -> str:
    return checkpoint(LLAMA)


@pytest.fixture(scope="module")
def llm(llama: str) -> LLM:
    return LLM(llama, dtype="float32", num_gpu_blocks=NUM_BLOCKS, seed=0)


@pytest.fixture(scope="module")
def spec_llm(llama: str) -> LLM:
    spec = {"method": "ngram", "num_speculative_tokens": K, "disable_by_batch_size": 64}
    return LLM(llama, dtype="float32", num_gpu_blocks=NUM_BLOCKS, seed=0, speculative_config=spec)


@cache
def hf_next(path: str, tokens: tuple[int, ...]) -> torch.Tensor:
    """HF's fp32 logits for the token after `tokens`."""
    with torch.no_grad():
        return hf_model(path)(torch.tensor([list(tokens)])).logits[0, -1].float()


def greedy(**kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **kwargs)


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_processors_on_rows_of_logits() -> None:
    """Only the rows that ask are touched; a masked token stays -inf whatever its bias."""
    logits = torch.zeros(4, 10)
    params = [
        SamplingParams(logit_bias={3: 2.5, 5: -1.0}),
        SamplingParams(),
        SamplingParams(logit_bias={5: 100.0}, allowed_token_ids=[1, 2]),
        SamplingParams(bad_words=["x"]),
    ]
    params[3]._bad_words_token_ids = [[7], [8, 9], [4, 9]]  # as resolve_bad_words would set
    past = {3: [1, 8]}
    apply_logits_processors(logits, params, lambda i: past.get(i, []))
    want = torch.zeros(4, 10)
    want[0, 3], want[0, 5] = 2.5, -1.0
    want[2] = float("-inf")
    want[2, [1, 2]] = 0.0
    want[3, [7, 9]] = float("-inf")  # 7 always; 9 after 8, not after 4
    assert torch.equal(logits, want)


def test_logit_bias_plus_100_makes_greedy_output_that_token(llm: LLM, llama: str) -> None:
    prompts = mixed_prompts()[:4]
    refs = [hf_greedy(llama, p, MAX_TOKENS) for p in prompts]
    token = next(t for t in range(2, 300) if all(t not in r for r in refs))
    assert run(llm, prompts, greedy(logit_bias={token: 100.0})) == [[token] * MAX_TOKENS] * 4
    # -100 on each prompt's greedy first token: the first token is HF's runner-up instead.
    for prompt, ref in zip(prompts, refs, strict=True):
        (out,) = run(llm, [prompt], greedy(logit_bias={str(ref[0]): -100}))
        runner_up = hf_next(llama, tuple(prompt)).topk(2).indices[1].item()
        assert out[0] == runner_up != ref[0]


def test_allowed_token_ids_pick_the_best_allowed_token(llm: LLM, llama: str) -> None:
    prompt = mixed_prompts()[3]
    ref = hf_greedy(llama, prompt, MAX_TOKENS)
    allowed = [t for t in range(40, 300, 7) if t not in ref[:4]]
    (out,) = run(llm, [prompt], greedy(allowed_token_ids=allowed))
    for step, token in enumerate(out):
        logits = hf_next(llama, tuple(prompt + out[:step]))
        best = max(allowed, key=lambda t: logits[t].item())
        assert token == best, step
    sampled = SamplingParams(temperature=1.5, seed=3, max_tokens=64, allowed_token_ids=allowed)
    (drawn,) = run(llm, [prompt], sampled)
    assert set(drawn) <= set(allowed) and len(set(drawn)) > 1


def word_of(tokens: list[int]) -> str | None:
    """The word whose tokens (as written or after a space) are exactly `tokens`, if any."""
    tok = tiny_tokenizer()
    word = tok.decode(tokens).strip()
    variants = [tok.encode(t, add_special_tokens=False) for t in (word, " " + word)]
    return word if word and tokens in variants else None


def bad_word_case(llama: str) -> tuple[list[int], list[int], int, str]:
    """A prompt, its greedy output and an index `i` of that output whose two tokens
    `out[i:i + 2]` are the tokens of a word that no one token spells; `i % (K + 1)` is 1 or
    2, so with drafts from the unbanned output both tokens are drafted in one step."""
    tok = tiny_tokenizer()
    for prompt in mixed_prompts():
        ref = hf_greedy(llama, prompt, MAX_TOKENS)
        for i in range(1, MAX_TOKENS - 1):
            word = word_of(ref[i : i + 2])
            if word is None or i % (K + 1) not in (1, 2):
                continue
            variants = [tok.encode(t, add_special_tokens=False) for t in (word, " " + word)]
            if all(len(v) > 1 for v in variants):
                return prompt, ref, i, word
    raise AssertionError("no two-token word in the greedy outputs")


def contains(tokens: Sequence[int], seq: Sequence[int]) -> bool:
    n = len(seq)
    return any(list(tokens[j : j + n]) == list(seq) for j in range(len(tokens) - n + 1))


def best_without(llama: str, prefix: list[int], banned: int) -> int:
    logits = hf_next(llama, tuple(prefix)).clone()
    logits[banned] = float("-inf")
    return int(logits.argmax().item())


def test_bad_words_never_appear_even_where_greedy_writes_them(llm: LLM, llama: str) -> None:
    prompt, ref, i, word = bad_word_case(llama)
    params = greedy(bad_words=[word])
    (out,) = run(llm, [prompt], params)
    for seq in params.bad_words_token_ids:
        assert not contains(out, seq)
    # Up to the word's last token nothing changes; there, the best other token comes instead.
    assert out[: i + 1] == ref[: i + 1]
    assert out[i + 1] == best_without(llama, prompt + ref[: i + 1], ref[i + 1])
    # A one-token word is banned everywhere, from its first place in the greedy output on.
    j = next(j for j in range(MAX_TOKENS) if word_of(ref[j : j + 1]) is not None)
    (out,) = run(llm, [prompt], greedy(bad_words=[word_of(ref[j : j + 1])]))
    assert ref[j] not in out
    assert out[:j] == ref[:j] and out[j] == best_without(llama, prompt + ref[:j], ref[j])


class Continuation:
    """Drafts the next tokens of a known continuation of each prompt while the sequence
    follows it; `plant`: every other proposal's second draft is wrong (a rejection)."""

    def __init__(self, prompts: list[list[int]], conts: list[list[int]], plant: bool) -> None:
        self.known = [(list(p), list(c)) for p, c in zip(prompts, conts, strict=True)]
        self.plant = plant
        self.proposals: list[list[int]] = []

    def propose(self, tokens: np.ndarray, max_tokens: int | None = None) -> list[int]:
        seq = tokens.tolist()
        for prompt, cont in self.known:
            done = len(seq) - len(prompt)
            if done >= 0 and seq[: len(prompt)] == prompt and seq[len(prompt) :] == cont[:done]:
                drafts = cont[done : done + min(K, max_tokens or K)]
                if self.plant and len(self.proposals) % 2 and len(drafts) > 1:
                    drafts[1] = (drafts[1] + 1) % 256
                self.proposals.append(drafts)
                return drafts
        return []


def spec_run(
    spec_llm: LLM,
    prompts: list[list[int]],
    conts: list[list[int]],
    params: SamplingParams,
    plant: bool,
) -> tuple[list[list[int]], Continuation, Any]:
    engine = spec_llm.llm_engine
    oracle = Continuation(prompts, conts, plant)
    engine.drafter.proposer = oracle
    before = (
        engine.get_stats().spec_decode_num_draft_tokens,
        engine.get_stats().spec_decode_num_accepted_tokens,
    )
    out = run(spec_llm, prompts, params)
    stats = engine.get_stats()
    return (
        out,
        oracle,
        (
            stats.spec_decode_num_draft_tokens - before[0],
            stats.spec_decode_num_accepted_tokens - before[1],
        ),
    )


@pytest.mark.parametrize("processor", ["logit_bias", "allowed_token_ids", "bad_words"])
def test_processors_give_the_same_tokens_with_drafts(
    llm: LLM, spec_llm: LLM, llama: str, processor: str
) -> None:
    prompt, ref, i, word = bad_word_case(llama)
    prompts = [prompt, *mixed_prompts()[:3]]
    plain = [hf_greedy(llama, p, MAX_TOKENS) for p in prompts]
    # Each keeps the first prompt's greedy start (so the unprocessed drafts are proposed) and
    # forbids its token i + 1 at least there.
    settings = {
        "logit_bias": {ref[i + 1]: -100.0, 77: 0.5},
        "allowed_token_ids": sorted({*ref[: i + 1], 77, 78, 91, 130, 131} - {ref[i + 1]}),
        "bad_words": [word],
    }
    params = greedy(**{processor: settings[processor]})
    want = run(llm, prompts, params)
    assert want != plain  # the processor changes the output
    # Drafts of the processed output, with planted errors: accepted and rejected ones.
    got, _, (drafted, accepted) = spec_run(spec_llm, prompts, want, params, plant=True)
    assert got == want and 0 < accepted < drafted
    # Drafts of the unprocessed output: what the processor forbids is drafted and rejected.
    got, oracle, (drafted, accepted) = spec_run(spec_llm, prompts, plain, params, plant=False)
    assert got == want and accepted < drafted
    if processor == "bad_words":  # the word's two tokens were drafted in one step
        assert any(contains(p, ref[i : i + 2]) for p in oracle.proposals)
