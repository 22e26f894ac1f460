"""Echo, prompt logprobs and the sampling fields of issue 34 over HTTP, on one `tokenwise serve`.

lm-evaluation-harness scores multiple-choice answers with `local-completions` by sending
`{"prompt": [[ids]], "max_tokens": 1, "logprobs": 1, "echo": true}` (or `max_tokens: 0`) and
reading the prompt tokens' logprobs from `logprobs.token_logprobs`. Expected values come from
transformers (fp32 log-softmax of the prompt, within 1e-4) and from the offline `LLM` on the
same checkpoint (`prompt_logprobs`, greedy tokens under the same processors).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import torch

from tests.engine._fixtures import LLAMA, checkpoint, hf_model, mixed_prompts
from tests.entrypoints._server import RemoteServer
from tokenwise import LLM, SamplingParams

NAME = "tiny"
TOL = 1e-4


@pytest.fixture(scope="module")
def model_dir() -> str:
    return checkpoint(LLAMA)


@pytest.fixture(scope="module", autouse=True)
def booting_server(model_dir: str):
    # Chunks of 16 tokens: the longer prompts are scored over several steps in the server too.
    args = ("--served-model-name", NAME, "--max-num-batched-tokens", "16")
    with RemoteServer(model_dir, *args, wait=False) as srv:
        yield srv


@pytest.fixture(scope="module")
def server(booting_server: RemoteServer) -> RemoteServer:
    return booting_server.wait_healthy()


@pytest.fixture(scope="module")
def llm(model_dir: str) -> LLM:
    return LLM(model_dir, dtype="float32", device="cpu", kv_cache_memory=16 << 20)


def post(server: RemoteServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url(path), json={"model": NAME, **body}, timeout=60.0)


def completion(server: RemoteServer, body: dict) -> dict:
    response = post(server, "/v1/completions", body)
    assert response.status_code == 200, response.text
    return response.json()


def hf_token_logprobs(path: str, prompt: list[int]) -> list[float]:
    """HF's fp32 logprob of each prompt token after the first, given those before it."""
    with torch.no_grad():
        logits = hf_model(path)(torch.tensor([prompt])).logits[0].float()
    rows = torch.log_softmax(logits, dim=-1)
    return [rows[t - 1, prompt[t]].item() for t in range(1, len(prompt))]


def offline_prompt_logprobs(llm: LLM, prompt: list[int], top: int = 1) -> list[Any]:
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=top)
    return llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].prompt_logprobs


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_lm_eval_loglikelihood_request(
    server: RemoteServer, llm: LLM, model_dir: str, max_tokens: int
) -> None:
    prompts = [mixed_prompts()[i] for i in (3, 13)]  # 11 and 57 tokens
    body = {"prompt": prompts, "max_tokens": max_tokens, "logprobs": 1, "echo": True}
    reply = completion(server, {**body, "temperature": 0.0})
    tokenizer = llm.get_tokenizer()
    for prompt, choice in zip(prompts, reply["choices"], strict=True):
        lps = choice["logprobs"]
        generated = len(lps["tokens"]) - len(prompt)
        assert generated == max_tokens
        assert choice["text"].startswith(tokenizer.decode(prompt))
        assert choice["finish_reason"] == "length"
        assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
        echoed = lps["token_logprobs"][1 : len(prompt)]
        assert echoed == pytest.approx(hf_token_logprobs(model_dir, prompt), abs=TOL)
        offline = offline_prompt_logprobs(llm, prompt)
        want = [offline[t][prompt[t]].logprob for t in range(1, len(prompt))]
        assert echoed == pytest.approx(want, abs=TOL)
        # lm-eval's is_greedy: the token is its position's top-1 exactly when it is ranked 1.
        for t in range(1, len(prompt)):
            top = lps["top_logprobs"][t]
            best = max(top.values())
            token_rank = offline[t][prompt[t]].rank
            assert (lps["token_logprobs"][t] == best) == (token_rank == 1)
        assert lps["text_offset"][0] == 0
    assert reply["usage"]["completion_tokens"] == len(prompts) * max_tokens
    assert reply["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)


def test_echo_of_a_text_prompt_streamed_and_not(server: RemoteServer) -> None:
    body = {"prompt": "Hello world", "max_tokens": 5, "echo": True, "temperature": 0.0}
    plain = completion(server, {**body, "ignore_eos": True})["choices"][0]
    generated = completion(server, {**body, "echo": False, "ignore_eos": True})["choices"][0]
    assert plain["text"] == "Hello world" + generated["text"]
    with_lps = completion(server, {**body, "ignore_eos": True, "logprobs": 2})["choices"][0]
    streamed, streamed_lps = "", []
    stream_body = {"model": NAME, **body, "ignore_eos": True, "logprobs": 2, "stream": True}
    with httpx.stream("POST", server.url("/v1/completions"), json=stream_body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                streamed += choice["text"]
                if choice["logprobs"] is not None:
                    streamed_lps += choice["logprobs"]["token_logprobs"]
    assert streamed == with_lps["text"] == plain["text"]
    assert streamed_lps == pytest.approx(with_lps["logprobs"]["token_logprobs"])


def test_prompt_logprobs_field_on_completions_and_chat(server: RemoteServer, llm: LLM) -> None:
    prompt = mixed_prompts()[6]  # 17 tokens
    offline = offline_prompt_logprobs(llm, prompt, top=2)
    choice = completion(server, {"prompt": prompt, "max_tokens": 2, "prompt_logprobs": 2})
    got = choice["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(prompt)
    for entry, want in zip(got[1:], offline[1:], strict=True):
        assert {int(t) for t in entry} == set(want)
        for t, value in entry.items():
            assert value["logprob"] == pytest.approx(want[int(t)].logprob, abs=TOL)
            assert value["rank"] == want[int(t)].rank
    messages = [{"role": "user", "content": "Hello world"}]
    tokens = post(server, "/tokenize", {"messages": messages}).json()["tokens"]
    reply = post(
        server,
        "/v1/chat/completions",
        {"messages": messages, "max_tokens": 1, "prompt_logprobs": 0},
    ).json()
    scored = reply["prompt_logprobs"]
    assert len(scored) == len(tokens) and scored[0] is None
    want = offline_prompt_logprobs(llm, tokens, top=0)
    for t in range(1, len(tokens)):
        assert set(scored[t]) == {str(tokens[t])}
        value = scored[t][str(tokens[t])]["logprob"]
        assert value == pytest.approx(want[t][tokens[t]].logprob, abs=TOL)


def test_processors_and_truncation_match_the_offline_engine(server: RemoteServer, llm: LLM) -> None:
    prompt = mixed_prompts()[4]
    greedy = {"prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    fields = [
        {"logit_bias": {"77": 100}},
        {"allowed_token_ids": [40, 77, 91, 130]},
        {"bad_words": ["he", "the"], "logit_bias": {"77": 3.5}},
    ]
    for extra in fields:
        reply = completion(server, {**greedy, **extra})["choices"][0]
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, **extra)
        (want,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        assert reply["text"] == want.outputs[0].text, extra
    assert completion(server, {**greedy, "logit_bias": {"77": 100}})["choices"][0]["text"] == (
        llm.get_tokenizer().decode([77] * 8)
    )
    reply = completion(server, {**greedy, "truncate_prompt_tokens": 4, "echo": True})
    assert reply["usage"]["prompt_tokens"] == 4
    assert reply["choices"][0]["text"].startswith(llm.get_tokenizer().decode(prompt[-4:]))


def test_a_bad_word_that_is_not_unicode_is_a_400_naming_it(server: RemoteServer) -> None:
    # JSON may hold a lone UTF-16 surrogate, which no tokenizer can encode (other bad values of
    # the new fields: test_server_errors.py).
    body = '{"model": "tiny", "prompt": "Hi", "max_tokens": 1, "bad_words": ["ok", "\\ud800"]}'
    response = httpx.post(
        server.url("/v1/completions"),
        content=body,
        headers={"Content-Type": "application/json"},
        timeout=60.0,
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "bad_words"
