"""What the engine checks and does with the sampling fields that need the model: token ids
within the vocabulary, bad words needing a tokenizer, and the prompt cut by
`truncate_prompt_tokens` (the output must be HF's greedy continuation of the kept tokens)."""

from __future__ import annotations

import pytest

from tests.engine._fixtures import LLAMA, NUM_BLOCKS, checkpoint, hf_greedy, mixed_prompts
from tokenwise import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(checkpoint(LLAMA), dtype="float32", num_gpu_blocks=NUM_BLOCKS, max_model_len=64)


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm: LLM) -> None:
    path = checkpoint(LLAMA)
    prompt = mixed_prompts()[15]  # 95 tokens: longer than max_model_len
    cases = {5: prompt[-5:], -1: prompt[-63:], 200: None}
    for keep, kept in cases.items():
        params = SamplingParams(
            temperature=0.0, max_tokens=1, ignore_eos=True, truncate_prompt_tokens=keep
        )
        if kept is None:  # nothing cut: the prompt is still too long
            with pytest.raises(ValueError, match="max_model_len"):
                llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
            continue
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        assert out.prompt_token_ids == kept
        assert list(out.outputs[0].token_ids) == hf_greedy(path, kept, 1)
    text = "Once upon a time there was a tiny model that predicted"
    (out,) = llm.generate([text], SamplingParams(max_tokens=1, truncate_prompt_tokens=3))
    tokenizer = llm.get_tokenizer()
    assert out.prompt_token_ids == tokenizer.encode(text)[-3:]
    assert out.prompt == tokenizer.decode(out.prompt_token_ids)  # what the model read


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"logit_bias": {10**6: 1.0}}, "logit_bias"),
        ({"allowed_token_ids": [1, 10**6]}, "allowed_token_ids"),
        ({"prompt_logprobs": 10**6}, "prompt_logprobs"),
    ],
)
def test_token_ids_beyond_the_vocabulary_are_refused(llm: LLM, kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=rf"^{name}"):
        llm.generate(["Hello"], SamplingParams(**kwargs), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_bad_words_need_a_tokenizer() -> None:
    llm = LLM(
        checkpoint(LLAMA), dtype="float32", num_gpu_blocks=NUM_BLOCKS, skip_tokenizer_init=True
    )
    with pytest.raises(ValueError, match="^bad_words need a tokenizer"):
        llm.generate([[5, 6]], SamplingParams(bad_words=["x"]), use_tqdm=False)
