"""Engine behaviour beyond raw correctness: prefix caching, aborts, stop conditions, n > 1,
seeds, streaming deltas and length limits.

Expected tokens come from Hugging Face greedy decoding (see `_fixtures.py`); expected texts,
block counts and cache hits are derived by hand from those tokens and the block size.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.engine._fixtures import (
    BLOCK_SIZE,
    LLAMA,
    NUM_BLOCKS,
    assert_pool_clean,
    checkpoint,
    hf_greedy,
    hf_greedy_until,
    mixed_prompts,
    random_ids,
    tokenizer,
)
from tokenwise import LLM, SamplingParams
from tokenwise.outputs import RequestOutput

EOS = 0  # the tiny tokenizer's <|endoftext|>


@pytest.fixture(scope="module")
def path() -> str:
    return checkpoint(LLAMA)


def make_llm(path: str, **overrides: Any) -> LLM:
    kwargs: dict[str, Any] = {"dtype": "float32", "num_gpu_blocks": NUM_BLOCKS}
    kwargs.update(overrides)
    return LLM(path, **kwargs)


@pytest.fixture(scope="module")
def llm(path: str) -> LLM:
    return make_llm(path)


_fresh = itertools.count(1000)


def fresh_prompt(length: int) -> list[int]:
    """Random ids no other test uses, so nothing is in the prefix cache for them yet."""
    return random_ids(torch.Generator().manual_seed(next(_fresh)), length)


def greedy(max_tokens: int, **kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def expected_text(token_ids: list[int]) -> str:
    """The text the incremental detokenizer must produce for these tokens: the plain decode,
    except that a trailing incomplete UTF-8 sequence (U+FFFD) is never emitted (as in vLLM)."""
    return tokenizer().decode(token_ids, skip_special_tokens=True).rstrip("\ufffd")


def run_to_completion(engine: Any, max_steps: int = 1000) -> dict[str, list[RequestOutput]]:
    """Step until idle; every request's deltas in order."""
    deltas: dict[str, list[RequestOutput]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return deltas
        for out in engine.step():
            deltas.setdefault(out.request_id, []).append(out)
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


def merged(deltas: list[RequestOutput]) -> RequestOutput:
    total = RequestOutput(deltas[0].request_id, deltas[0].prompt, deltas[0].prompt_token_ids, [])
    for d in deltas:
        total.merge(d)
    return total


def pick_stop_string(path: str) -> tuple[list[int], list[int], str, int]:
    """(prompt, HF greedy tokens, stop string, char offset of its first occurrence).

    The stop string is 3 ASCII letters/digits taken from HF's own continuation, occurring
    first at character 3 or later and spanning a token boundary (so it only forms once a
    later token arrives), which makes it certain to occur and exercises the hold-back."""
    tok = tokenizer()
    for prompt in mixed_prompts():
        ref = hf_greedy(path, prompt, 24)
        text = tok.decode(ref)
        for at in range(3, len(text) - 2):
            stop = text[at : at + 3]
            if not (stop.isascii() and stop.isalnum()) or text.find(stop) != at:
                continue
            end = next(j for j in range(1, len(ref) + 1) if stop in tok.decode(ref[:j]))
            if stop not in tok.decode([ref[end - 1]]):
                return prompt, ref, stop, at
    raise AssertionError("no usable stop string in any continuation")


# ------------------------------------------------------------------ prefix caching


def shared_prefix_batch() -> list[list[int]]:
    prefix = fresh_prompt(40)
    return [prefix + fresh_prompt(n) for n in (1, 9, 24)] + [prefix]


def test_prefix_cache_saves_prompt_work(llm: LLM, path: str) -> None:
    engine = llm.llm_engine
    prompts = shared_prefix_batch()
    refs = [hf_greedy(path, p, 4) for p in prompts]
    params = greedy(4, ignore_eos=True)

    def run() -> tuple[list[RequestOutput], int, int]:
        before = engine.get_stats()
        tokens, hits = before.prompt_tokens_total, before.prefix_cache_hits
        outs = llm.generate(prompts, params, use_tqdm=False)
        after = engine.get_stats()
        assert [o.outputs[0].token_ids for o in outs] == refs
        assert_pool_clean(engine)
        return outs, after.prompt_tokens_total - tokens, after.prefix_cache_hits - hits

    first, computed_first, hits_first = run()
    # Within the first batch the later prompts reuse the two full blocks (32 tokens) of the
    # 40-token prefix that the first prompt computes in the same step.
    assert [o.num_cached_tokens for o in first] == [0, 32, 32, 32]
    assert hits_first == 3 * 32
    assert computed_first == sum(len(p) for p in prompts) - 3 * 32

    second, computed_second, hits_second = run()
    # Now every full block is cached; the last prompt token always runs through the model.
    cached = [(len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE for p in prompts]
    assert [o.num_cached_tokens for o in second] == cached == [32, 48, 48, 32]
    assert hits_second == sum(cached)
    assert computed_second == sum(len(p) - c for p, c in zip(prompts, cached, strict=True))
    assert 0 < computed_second < computed_first


def test_no_hits_across_requests_without_prefix_caching(path: str) -> None:
    llm = make_llm(path, enable_prefix_caching=False)
    engine = llm.llm_engine
    prompts = shared_prefix_batch()
    refs = [hf_greedy(path, p, 4) for p in prompts]
    for _ in range(2):
        before = engine.get_stats().prompt_tokens_total
        outs = llm.generate(prompts, greedy(4, ignore_eos=True), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == refs
        assert [o.num_cached_tokens for o in outs] == [0] * len(prompts)
        assert engine.get_stats().prompt_tokens_total - before == sum(len(p) for p in prompts)
        assert engine.get_stats().prefix_cache_hits == 0
        assert_pool_clean(engine)


# ------------------------------------------------------------------------- aborts


def test_abort_mid_generation_frees_blocks_and_spares_the_others(llm: LLM, path: str) -> None:
    engine = llm.llm_engine
    prompts = {"a": fresh_prompt(20), "b": fresh_prompt(30), "c": fresh_prompt(25)}
    params = greedy(12, ignore_eos=True)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    deltas: dict[str, list[RequestOutput]] = {}
    for _ in range(3):  # prefill + two decodes: b has computed its prompt and 2 outputs
        for out in engine.step():
            deltas.setdefault(out.request_id, []).append(out)
    assert len(merged(deltas["b"]).outputs[0].token_ids) == 3
    free_before = engine.block_manager.get_num_free_blocks()
    engine.abort_request("b")
    engine.abort_request("no-such-request")  # unknown ids are ignored
    blocks_of_b = -(-(30 + 2) // BLOCK_SIZE)
    assert engine.block_manager.get_num_free_blocks() == free_before + blocks_of_b
    engine.block_manager.check_invariants()

    step = engine.step()
    reported = [o for o in step if o.request_id == "b"]
    assert len(reported) == 1 and reported[0].finished
    assert [c.finish_reason for c in reported[0].outputs] == ["abort"]
    for out in step:
        deltas.setdefault(out.request_id, []).append(out)
    for rid, outs in run_to_completion(engine).items():
        assert rid != "b", "an aborted request is reported once"
        deltas[rid].extend(outs)
    for rid in ("a", "c"):
        final = merged(deltas[rid])
        assert final.finished and final.outputs[0].finish_reason == "length"
        assert final.outputs[0].token_ids == hf_greedy(path, prompts[rid], 12)
    assert merged(deltas["b"]).outputs[0].token_ids == hf_greedy(path, prompts["b"], 3)
    assert_pool_clean(engine)


def test_abort_before_scheduling(llm: LLM) -> None:
    engine = llm.llm_engine
    engine.add_request("waiting", fresh_prompt(10), greedy(4))
    engine.abort_request(["waiting"])
    outs = engine.step()
    assert [o.request_id for o in outs] == ["waiting"]
    assert outs[0].finished
    assert outs[0].outputs[0].finish_reason == "abort"
    assert outs[0].outputs[0].token_ids == []
    assert engine.step() == []
    assert_pool_clean(engine)


def test_every_accepted_request_finishes(path: str) -> None:
    """A crowded engine (8 blocks, 16-token budget, 4 sequences) with mixed requests and a
    few aborts: each request reports exactly one final output, last; nothing leaks."""
    llm = make_llm(
        path, num_gpu_blocks=8, max_model_len=128, max_num_batched_tokens=16, max_num_seqs=4
    )
    engine = llm.llm_engine
    g = torch.Generator().manual_seed(7)
    expected_n: dict[str, int] = {}
    greedy_refs: dict[str, list[int]] = {}
    for i in range(14):
        prompt = random_ids(g, 5 + 7 * i % 60)
        max_tokens = 1 + 3 * i % 16
        if i % 4 == 0:
            params = greedy(max_tokens, ignore_eos=True)
            greedy_refs[f"r{i}"] = hf_greedy(path, prompt, max_tokens)
        elif i % 4 == 1:
            params = SamplingParams(temperature=0.8, seed=i, max_tokens=max_tokens, n=2)
        elif i % 4 == 2:
            params = SamplingParams(temperature=1.0, max_tokens=max_tokens, stop_token_ids=[5])
        else:
            params = SamplingParams(top_k=5, max_tokens=max_tokens, min_tokens=max_tokens // 2)
        engine.add_request(f"r{i}", prompt, params)
        expected_n[f"r{i}"] = params.n
    aborted = {"r7", "r12"}  # 54- and 29-token prompts: still prefilling at step 2
    deltas: dict[str, list[RequestOutput]] = {}
    for step in itertools.count():
        if step == 2:
            engine.abort_request(sorted(aborted))
        if not engine.has_unfinished_requests():
            break
        assert step < 2000
        for out in engine.step():
            assert not deltas.get(out.request_id) or not deltas[out.request_id][-1].finished
            deltas.setdefault(out.request_id, []).append(out)
    assert set(deltas) == set(expected_n)
    for rid, outs in deltas.items():
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        final = merged(outs)
        assert [c.index for c in final.outputs] == list(range(expected_n[rid]))
        reasons = {c.finish_reason for c in final.outputs}
        if rid in aborted:
            assert reasons == {"abort"}
        else:
            assert reasons <= {"stop", "length"}
        if rid in greedy_refs and rid not in aborted:
            assert final.outputs[0].token_ids == greedy_refs[rid]
    assert engine.scheduler.num_preemptions > 0  # the crowding was real
    assert_pool_clean(engine)


# -------------------------------------------------------------------- stop conditions


@pytest.mark.parametrize("include", [False, True])
def test_stop_string(llm: LLM, path: str, include: bool) -> None:
    prompt, ref, stop, at = pick_stop_string(path)
    tok = tokenizer()
    end = next(j for j in range(1, len(ref) + 1) if stop in tok.decode(ref[:j]))
    params = greedy(24, ignore_eos=True, stop=["never-occurs", stop])
    params.include_stop_str_in_output = include
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop
    assert out.token_ids == ref[:end]  # stops at the token that completes the string
    full = tok.decode(ref[:end])
    assert out.text == (full[: at + len(stop)] if include else full[:at])
    assert_pool_clean(llm.llm_engine)


def _prompts_with_fresh_third_token(path: str) -> Iterator[tuple[list[int], list[int]]]:
    """Prompts whose greedy 3rd token is neither EOS nor one of the first two tokens."""
    for prompt in mixed_prompts():
        ref = hf_greedy(path, prompt, 16)
        if ref[2] not in ref[:2] and EOS not in ref[:3]:
            yield prompt, ref


def test_stop_token_ids(llm: LLM, path: str) -> None:
    prompt, ref = next(_prompts_with_fresh_third_token(path))
    out = llm.generate(prompt, greedy(16, stop_token_ids=[ref[2]]), use_tqdm=False)[0]
    completion = out.outputs[0]
    assert completion.token_ids == ref[:3]  # the stop token is part of token_ids
    assert completion.finish_reason == "stop"
    assert completion.stop_reason == ref[2]
    # As in vLLM, the stop token's text is left out unless include_stop_str_in_output.
    tok = llm.get_tokenizer()
    assert completion.text == tok.decode(ref[:2]).rstrip("\ufffd")
    kept = greedy(16, stop_token_ids=[ref[2]], include_stop_str_in_output=True)
    kept_text = llm.generate(prompt, kept, use_tqdm=False)[0].outputs[0].text
    assert kept_text == tok.decode(ref[:3]).rstrip("\ufffd")
    assert_pool_clean(llm.llm_engine)


def test_min_tokens_defers_a_stop_token(llm: LLM, path: str) -> None:
    """Greedy would emit the stop token at step 3; min_tokens=6 bans it until 6 tokens exist.
    The prompt is one where greedy emits the stop token again later, so the request ends by
    the stop token, after the minimum (HF's min_new_tokens is the same rule)."""
    for prompt, ref in _prompts_with_fresh_third_token(path):
        want = hf_greedy_until(path, prompt, 16, stop_token=ref[2], min_new_tokens=6)
        if want[-1] == ref[2]:
            break
    else:
        raise AssertionError("no prompt re-emits its 3rd token after 6 tokens")
    stop = ref[2]
    assert 6 < len(want) < 16
    params = greedy(16, ignore_eos=True, stop_token_ids=[stop], min_tokens=6)
    completion = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert completion.token_ids == want
    assert stop not in completion.token_ids[:-1]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
    assert_pool_clean(llm.llm_engine)


_EOS_CANDIDATES = [
    "Hello world! Hello tokenwise, a small inference engine",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibo",
    "Once upon a time there was a tiny",
]


def test_eos_stops_unless_ignore_eos(llm: LLM, path: str) -> None:
    """The tiny checkpoint's weights are fixed by its seed, so which candidate prompt reaches
    EOS is fixed too: if none does, the checkpoint changed and the candidates need updating."""
    tok = tokenizer()
    found = None
    for text in _EOS_CANDIDATES:
        prompt = tok.encode(text)
        ref = hf_greedy_until(path, prompt, 30)
        if ref[-1] == EOS:
            found = prompt, ref
            break
    assert found is not None, "no candidate prompt makes HF's greedy output reach EOS in 30"
    prompt, ref = found
    n = len(ref)

    stopped = llm.generate(prompt, greedy(30), use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == ref
    assert stopped.finish_reason == "stop"
    assert stopped.stop_reason is None  # EOS, not a user stop condition
    assert stopped.text == expected_text(ref)  # the special EOS token is not in the text

    ignored = llm.generate(prompt, greedy(n + 3, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert ignored.token_ids == hf_greedy(path, prompt, n + 3)
    assert ignored.token_ids[n - 1] == EOS
    assert ignored.finish_reason == "length"

    # min_tokens also holds EOS back (HF's min_new_tokens does the same).
    deferred = llm.generate(prompt, greedy(30, min_tokens=n + 2), use_tqdm=False)[0].outputs[0]
    assert deferred.token_ids == hf_greedy_until(path, prompt, 30, min_new_tokens=n + 2)
    assert len(deferred.token_ids) >= n + 2
    assert EOS not in deferred.token_ids[: n + 1]
    assert_pool_clean(llm.llm_engine)


def test_max_tokens_finishes_with_length(llm: LLM, path: str) -> None:
    prompts = mixed_prompts()[:4]
    outs = llm.generate(prompts, greedy(5, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        completion = out.outputs[0]
        assert completion.token_ids == hf_greedy(path, prompt, 5)
        assert (completion.finish_reason, completion.stop_reason) == ("length", None)
    assert_pool_clean(llm.llm_engine)


def test_max_model_len_caps_generation(path: str) -> None:
    llm = make_llm(path, max_model_len=48)
    prompt = fresh_prompt(40)
    for max_tokens in (16, None):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        completion = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        assert completion.token_ids == hf_greedy(path, prompt, 48 - 40)
        assert completion.finish_reason == "length"
    assert_pool_clean(llm.llm_engine)


# ---------------------------------------------------------------- sampling and seeds


def test_n_samples_are_seeded_distinct_and_share_the_prompt(llm: LLM, path: str) -> None:
    engine = llm.llm_engine
    prompt = fresh_prompt(40)  # two full blocks and a partial one
    params = SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=8, ignore_eos=True)
    hits_before = engine.get_stats().prefix_cache_hits
    first = llm.generate(prompt, params, use_tqdm=False)[0]
    # Sample 0 computes the prompt; its two siblings reuse both full blocks.
    assert engine.get_stats().prefix_cache_hits - hits_before >= 2 * 2 * BLOCK_SIZE
    assert [c.index for c in first.outputs] == [0, 1, 2]
    samples = [tuple(c.token_ids) for c in first.outputs]
    assert all(len(s) == 8 for s in samples)
    # 8 tokens drawn at temperature 1 from this model's broad distributions (top-1 logprobs
    # around -2.5): three identical samples, or a sample equal to greedy, would mean the
    # siblings share one random stream or do not sample at all.
    assert len(set(samples)) == 3
    assert tuple(hf_greedy(path, prompt, 8)) not in samples
    second = llm.generate(prompt, params, use_tqdm=False)[0]
    assert [tuple(c.token_ids) for c in second.outputs] == samples
    assert [c.text for c in second.outputs] == [c.text for c in first.outputs]
    assert_pool_clean(engine)


def test_seeded_sample_is_independent_of_the_batch(llm: LLM) -> None:
    prompt = fresh_prompt(21)
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=99, max_tokens=10)
    alone = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    others = [fresh_prompt(n) for n in (5, 40, 13, 70)]
    batch = [others[0], others[1], prompt, others[2], others[3]]
    batch_params = [
        SamplingParams(temperature=1.0, seed=5, max_tokens=12),
        greedy(6),
        params,
        SamplingParams(temperature=0.7, max_tokens=9, n=2),  # unseeded: uses the global RNG
        SamplingParams(temperature=1.0, max_tokens=3),
    ]
    outs = llm.generate(batch, batch_params, use_tqdm=False)
    assert outs[2].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.95, seed=100, max_tokens=10)
    assert llm.generate(prompt, other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone
    assert_pool_clean(llm.llm_engine)


# ------------------------------------------------------------------------- streaming


def test_step_deltas_concatenate_to_the_final_output(llm: LLM, path: str) -> None:
    engine = llm.llm_engine
    stop_prompt, stop_ref, stop, at = pick_stop_string(path)
    plain = mixed_prompts()[3]
    engine.add_request("plain", plain, greedy(12, ignore_eos=True))
    engine.add_request("stop", stop_prompt, greedy(24, ignore_eos=True, stop=stop))
    engine.add_request("n2", fresh_prompt(12), SamplingParams(n=2, seed=3, max_tokens=6))
    deltas = run_to_completion(engine)

    for rid, outs in deltas.items():
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True], rid
        for o in outs:
            assert all(len(c.token_ids) <= 1 for c in o.outputs), "one token per step"

    def concat(rid: str, index: int = 0) -> tuple[list[int], str]:
        ids: list[int] = []
        text = ""
        for o in deltas[rid]:
            for c in o.outputs:
                if c.index == index:
                    ids += c.token_ids
                    text += c.text
        return ids, text

    ids, text = concat("plain")
    assert ids == hf_greedy(path, plain, 12)
    assert text == expected_text(ids)

    ids, text = concat("stop")
    end = next(j for j in range(1, 25) if stop in tokenizer().decode(stop_ref[:j]))
    assert ids == stop_ref[:end]
    assert text == tokenizer().decode(ids)[:at]  # text that began the stop string held back
    assert all(stop not in c.text for o in deltas["stop"] for c in o.outputs)

    final = merged(deltas["n2"])
    for index in (0, 1):
        ids, text = concat("n2", index)
        assert ids == final.outputs[index].token_ids
        assert len(ids) == 6 or final.outputs[index].finish_reason == "stop"
        assert text == expected_text(ids)
    assert_pool_clean(engine)
