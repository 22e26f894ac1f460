"""The OpenAI-compatible server, driven by the official `openai` client over real HTTP.

Expected values come from `LLM.generate` on the same checkpoint in this process (greedy text,
token counts, logprobs) or from the tokenizer (prompt lengths), so a server that formats
correctly but generates, counts or streams wrongly fails.
"""

from __future__ import annotations

import re

import httpx
import pytest
from openai import OpenAI

from tests.entrypoints._server import RemoteServer, metric_value, openai_client
from tests.tiny_checkpoints import build_tiny_checkpoint
from tokenwise.entrypoints.llm import LLM
from tokenwise.sampling.params import SamplingParams

NAME = "tiny-llama"
PROMPTS = ["Hello world", "The cat sat on"]
GREEDY = {"temperature": 0.0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("openai-server"))


@pytest.fixture(scope="module", autouse=True)
def booting_server(model_dir: str):
    # Started first and awaited only in `server`, so `llm` loads while the server boots.
    with RemoteServer(model_dir, "--served-model-name", NAME, wait=False) as srv:
        yield srv


@pytest.fixture(scope="module")
def server(booting_server: RemoteServer) -> RemoteServer:
    return booting_server.wait_healthy()


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> OpenAI:
    return openai_client(server)


@pytest.fixture(scope="module")
def llm(model_dir: str) -> LLM:
    return LLM(model_dir, dtype="float32", device="cpu", kv_cache_memory=16 << 20)


def reference(llm: LLM, prompt, **overrides):
    """What the engine generates in-process for the server's greedy settings."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, **overrides)
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]


def test_completion_greedy_matches_llm_generate(llm: LLM, client: OpenAI) -> None:
    for prompt in PROMPTS:
        out = client.completions.create(model=NAME, prompt=prompt, **GREEDY)
        expected = reference(llm, prompt)
        assert out.object == "text_completion" and out.model == NAME
        assert out.choices[0].text == expected.text
        assert out.choices[0].finish_reason == "length"
        assert out.usage.prompt_tokens == len(llm.get_tokenizer().encode(prompt))
        assert out.usage.completion_tokens == 12
        assert out.usage.total_tokens == out.usage.prompt_tokens + 12


def test_completion_stream_matches_and_reports_usage(llm: LLM, client: OpenAI) -> None:
    chunks = list(
        client.completions.create(
            model=NAME,
            prompt=PROMPTS[0],
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == reference(llm, PROMPTS[0]).text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) <= {None}
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == len(llm.get_tokenizer().encode(PROMPTS[0]))


def test_batched_prompts_and_token_ids(llm: LLM, client: OpenAI) -> None:
    ids = llm.get_tokenizer().encode(PROMPTS[1])
    out = client.completions.create(model=NAME, prompt=PROMPTS, **GREEDY)
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == [reference(llm, p).text for p in PROMPTS]
    by_ids = client.completions.create(model=NAME, prompt=ids, **GREEDY)
    assert by_ids.choices[0].text == reference(llm, PROMPTS[1]).text
    batch_ids = client.completions.create(model=NAME, prompt=[ids, ids[:3]], **GREEDY)
    assert batch_ids.usage.prompt_tokens == len(ids) + 3


def test_n_choices_count_prompt_once(llm: LLM, client: OpenAI) -> None:
    out = client.completions.create(
        model=NAME, prompt=PROMPTS, n=3, max_tokens=6, seed=7, extra_body={"ignore_eos": True}
    )
    assert sorted(c.index for c in out.choices) == list(range(6))
    assert out.usage.completion_tokens == 6 * 6
    assert len({c.text for c in out.choices[:3]}) > 1  # sampled siblings differ
    prompt_len = sum(len(llm.get_tokenizer().encode(p)) for p in PROMPTS)
    assert out.usage.prompt_tokens == prompt_len


def test_seed_reproduces_and_different_seeds_differ(client: OpenAI) -> None:
    def sample(seed: int) -> str:
        return (
            client.completions.create(
                model=NAME, prompt=PROMPTS[0], temperature=1.0, max_tokens=10, seed=seed
            )
            .choices[0]
            .text
        )

    assert sample(123) == sample(123)
    assert len({sample(s) for s in (1, 2, 3, 4)}) > 1


def test_stop_string_and_stop_token_ids(llm: LLM, client: OpenAI) -> None:
    greedy = reference(llm, PROMPTS[0])
    window = next(
        greedy.text[i : i + 2]
        for i in range(1, len(greedy.text) - 1)
        if re.fullmatch(r"[A-Za-z]{2}", greedy.text[i : i + 2])
    )
    out = client.completions.create(model=NAME, prompt=PROMPTS[0], stop=[window], **GREEDY)
    expected = reference(llm, PROMPTS[0], stop=[window])
    assert out.choices[0].text == greedy.text[: greedy.text.find(window)] == expected.text
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == len(expected.token_ids) < 12

    stop_id = greedy.token_ids[3]
    out = client.completions.create(
        model=NAME, prompt=PROMPTS[0], **{**GREEDY, "extra_body": {"stop_token_ids": [stop_id]}}
    )
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == greedy.token_ids.index(stop_id) + 1


def test_completion_logprobs(llm: LLM, client: OpenAI) -> None:
    out = client.completions.create(model=NAME, prompt=PROMPTS[0], logprobs=2, **GREEDY)
    lp = out.choices[0].logprobs
    expected = reference(llm, PROMPTS[0], logprobs=2)
    want = [
        entry[t].logprob for t, entry in zip(expected.token_ids, expected.logprobs, strict=True)
    ]
    assert lp.token_logprobs == pytest.approx(want, abs=1e-3)
    assert len(lp.tokens) == len(lp.top_logprobs) == len(lp.text_offset) == 12
    for i, top in enumerate(lp.top_logprobs):
        # The top 2 plus the sampled token, keyed by text (distinct ids may decode alike).
        assert 1 <= len(top) <= 3
        assert top[lp.tokens[i]] == pytest.approx(lp.token_logprobs[i])
        assert lp.token_logprobs[i] == pytest.approx(max(top.values()))  # greedy picks the top
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(12)]


def test_chat_greedy_stream_and_logprobs(llm: LLM, client: OpenAI) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)  # the template writes its own BOS
    expected = reference(llm, {"prompt_token_ids": ids})
    out = client.chat.completions.create(model=NAME, messages=messages, **GREEDY)
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected.text
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), 12)

    chunks = list(
        client.chat.completions.create(
            model=NAME,
            messages=messages,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == expected.text
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].choices == []

    with_lp = client.chat.completions.create(
        model=NAME,
        messages=messages,
        logprobs=True,
        top_logprobs=3,
        max_completion_tokens=5,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    tokens = with_lp.choices[0].logprobs.content
    assert len(tokens) == with_lp.usage.completion_tokens == 5
    for token in tokens:
        tops = [t.logprob for t in token.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert token.logprob == pytest.approx(tops[0])
        assert bytes(token.bytes).decode() == token.token


def test_models_and_health(server: RemoteServer, client: OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [NAME]
    health = httpx.get(server.url("/health"), timeout=10.0)
    assert health.status_code == 200 and health.content == b""


def test_metrics_names_and_counters_move(server: RemoteServer, client: OpenAI) -> None:
    before = server.metrics()
    for name in (
        "tokenwise:num_requests_running",
        "tokenwise:num_requests_waiting",
        "tokenwise:kv_cache_usage_perc",
        "tokenwise:prefix_cache_queries_total",
        "tokenwise:prefix_cache_hits_total",
        "tokenwise:prompt_tokens_total",
        "tokenwise:generation_tokens_total",
        "tokenwise:time_to_first_token_seconds_bucket",
        "tokenwise:inter_token_latency_seconds_bucket",
        "tokenwise:e2e_request_latency_seconds_bucket",
        "tokenwise:request_success_total",
        'tokenwise:forward_time_per_batch_size_milliseconds{batch_size="',
    ):
        assert name in before, name
    client.completions.create(
        model=NAME, prompt="A fresh prompt", max_tokens=5, extra_body={"ignore_eos": True}
    )
    after = server.metrics()

    def delta(name: str, **labels: str) -> float:
        return metric_value(after, name, **labels) - metric_value(before, name, **labels)

    assert delta("tokenwise:generation_tokens_total") == 5
    assert delta("tokenwise:request_success_total", finished_reason="length") == 1
    assert delta("tokenwise:time_to_first_token_seconds_count") == 1
    assert delta("tokenwise:e2e_request_latency_seconds_count") == 1
    assert delta("tokenwise:inter_token_latency_seconds_count") == 4
    assert delta("tokenwise:prompt_tokens_total") > 0
    assert delta("tokenwise:prefix_cache_queries_total") > 0
    assert metric_value(after, "tokenwise:num_requests_running") == 0
