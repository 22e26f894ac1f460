"""What real clients send beyond the core API, over HTTP against one `tokenwise serve`: lenient
fields, `continuous_usage_stats`, the reasoning parser, `chat_template_kwargs`, `/tokenize`,
`/detokenize`, `/version`, `/ping`, the `vllm:` metric names and the access log.

The server runs `--reasoning-parser deepseek_r1` at `--log-level INFO` (so its access lines and
warnings are in its log) with an API key. Its checkpoint's tokenizer adds a BOS token (so
`add_special_tokens` makes a difference) and its chat template reads `enable_thinking`, as
Qwen3's does. Expected token ids come from that tokenizer and hand-written renderings of the
template, expected texts from the server's own `/v1/completions` on the same prompt tokens.
"""

from __future__ import annotations

import json
import os
import re
import time

import httpx
import pytest
from openai import OpenAI
from tokenizers import Tokenizer, processors
from transformers import AutoTokenizer

import tokenwise
from tests.entrypoints._server import RemoteServer, metric_value, wait_for_idle
from tests.tiny_checkpoints import BOS_TOKEN, build_tiny_checkpoint

NAME = "tiny-thinker"
KEY = "compat-key"
LAUNCHER = ("-m", "tokenwise.entrypoints.cli", "--log-level", "INFO")
THINKING_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
HI = [{"role": "user", "content": "Hi"}]
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = build_tiny_checkpoint(tmp_path_factory.mktemp("compat"))
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
        f.write(THINKING_TEMPLATE)
    tokenizer_file = os.path.join(path, "tokenizer.json")
    tok = Tokenizer.from_file(tokenizer_file)
    bos = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", special_tokens=[(BOS_TOKEN, bos)]
    )
    tok.save(tokenizer_file)
    return path


@pytest.fixture(scope="module", autouse=True)
def booting_server(model_dir: str):
    args = ("--served-model-name", NAME, "--api-key", KEY, "--reasoning-parser", "deepseek_r1")
    with RemoteServer(
        model_dir, *args, "--max-model-len", "128", launcher=LAUNCHER, wait=False
    ) as s:
        yield s


@pytest.fixture(scope="module")
def tokenizer(model_dir: str):
    tok = AutoTokenizer.from_pretrained(model_dir)  # loads while the server boots
    assert tok.encode("Hi")[0] == tok.convert_tokens_to_ids(BOS_TOKEN)  # BOS added
    return tok


@pytest.fixture(scope="module")
def server(booting_server: RemoteServer) -> RemoteServer:
    return booting_server.wait_healthy()


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> OpenAI:
    return OpenAI(base_url=server.url("/v1"), api_key=KEY, timeout=60.0, max_retries=0)


def post(server: RemoteServer, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url(path), json=body, headers=headers, timeout=60.0)


def ok(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


def error_of(response: httpx.Response, param: str, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    return error


def log_lines(server: RemoteServer, needle: str, timeout: float = 10.0) -> list[str]:
    """The server's log lines containing `needle`, once there is one (it is written after the
    response has been sent)."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [line for line in server.log(tail=None).splitlines() if needle in line]
        if lines or time.monotonic() > deadline:
            return lines
        time.sleep(0.1)


def completion_text(server: RemoteServer, prompt_ids: list[int], max_tokens: int) -> str:
    body = {"model": NAME, "prompt": prompt_ids, "max_tokens": max_tokens, **GREEDY}
    return ok(post(server, "/v1/completions", body))["choices"][0]["text"]


# ---- /tokenize, /detokenize, chat_template_kwargs ----------------------------------------------


def test_tokenize_prompt_as_completions_count_it(server: RemoteServer, tokenizer) -> None:
    prompt = "The cat sat on the mat."
    out = ok(post(server, "/tokenize", {"model": NAME, "prompt": prompt}))
    assert out["tokens"] == tokenizer.encode(prompt)
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == 128
    assert out["token_strs"] is None
    bare = ok(post(server, "/tokenize", {"prompt": prompt, "add_special_tokens": False}))
    assert bare["tokens"] == tokenizer.encode(prompt, add_special_tokens=False)
    strs = ok(post(server, "/tokenize", {"prompt": prompt, "return_token_strs": True}))
    assert strs["token_strs"] == tokenizer.convert_ids_to_tokens(out["tokens"])
    # The count is what a completion runs, with and without special tokens.
    body = {"model": NAME, "prompt": prompt, "max_tokens": 1}
    usage = ok(post(server, "/v1/completions", body))["usage"]
    assert usage["prompt_tokens"] == out["count"]
    usage = ok(post(server, "/v1/completions", {**body, "add_special_tokens": False}))["usage"]
    assert usage["prompt_tokens"] == bare["count"] == out["count"] - 1


def test_tokenize_messages_renders_the_template_with_its_kwargs(
    server: RemoteServer, tokenizer
) -> None:
    plain = ok(post(server, "/tokenize", {"messages": HI}))
    assert plain["tokens"] == tokenizer.encode(
        "<|user|>Hi\n<|assistant|>", add_special_tokens=False
    )
    no_thinking = {"messages": HI, "chat_template_kwargs": {"enable_thinking": False}}
    out = ok(post(server, "/tokenize", no_thinking))
    expected = "<|user|>Hi\n<|assistant|><think>\n\n</think>\n\n"
    assert out["tokens"] == tokenizer.encode(expected, add_special_tokens=False)
    # A chat completion runs exactly those tokens.
    body = {"model": NAME, **no_thinking, "max_tokens": 1}
    assert ok(post(server, "/v1/chat/completions", body))["usage"]["prompt_tokens"] == out["count"]
    continued = [*HI, {"role": "assistant", "content": "Once upon"}]
    body = {"messages": continued, "continue_final_message": True, "add_generation_prompt": False}
    out = ok(post(server, "/tokenize", body))
    expected = "<|user|>Hi\n<|assistant|>Once upon"
    assert out["tokens"] == tokenizer.encode(expected, add_special_tokens=False)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": HI, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
        (
            {"messages": HI, "chat_template_kwargs": {"add_generation_prompt": False}},
            "chat_template_kwargs",
        ),
        ({"messages": HI, "continue_final_message": True}, "continue_final_message"),
        ({"messages": []}, "messages"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": "x", "add_special_tokens": "no"}, "add_special_tokens"),
        ({"prompt": "x", "model": "other"}, "model"),
    ],
)
def test_bad_tokenize_requests_are_400_naming_the_field(
    server: RemoteServer, body: dict, param: str
) -> None:
    status = 404 if param == "model" else 400
    error_of(post(server, "/tokenize", body), param, status)


def test_detokenize_round_trip_and_bad_tokens(server: RemoteServer, tokenizer) -> None:
    ids = tokenizer.encode("Hello world!", add_special_tokens=False)
    assert ok(post(server, "/detokenize", {"tokens": ids})) == {"prompt": "Hello world!"}
    assert ok(post(server, "/detokenize", {"tokens": []})) == {"prompt": ""}
    error = error_of(post(server, "/detokenize", {"tokens": [5, 10**6]}), "tokens")
    assert "1000000" in error["message"]
    error_of(post(server, "/detokenize", {"tokens": [-1]}), "tokens")
    error_of(post(server, "/detokenize", {"tokens": "5"}), "tokens")
    error_of(post(server, "/detokenize", {}), "tokens")


def test_tokenize_needs_the_key_and_probes_do_not(server: RemoteServer) -> None:
    error_of(post(server, "/tokenize", {"prompt": "x"}, key=None), None, 401)
    error_of(post(server, "/detokenize", {"tokens": [1]}, key="wrong"), None, 401)
    for method in ("GET", "POST"):
        assert httpx.request(method, server.url("/ping"), timeout=10).status_code == 200
    version = httpx.get(server.url("/version"), timeout=10)
    assert version.status_code == 200 and version.json() == {"version": tokenwise.__version__}


# ---- lenient and refused fields ----------------------------------------------------------------


def test_unknown_and_ignored_fields_are_accepted_and_named_once(
    server: RemoteServer, client: OpenAI
) -> None:
    kwargs = {"model": NAME, "messages": HI, "max_tokens": 6, "temperature": 0.0}
    plain = client.chat.completions.create(**kwargs)
    extra = client.chat.completions.create(
        **kwargs,
        metadata={"team": "eval"},
        store=False,
        extra_body={"no_such_field": 1, "stream_options": None, "service_tier": "auto"},
    )
    assert extra.choices[0].message.reasoning_content == plain.choices[0].message.reasoning_content
    (line,) = [line for line in log_lines(server, extra.id) if "WARNING" in line]
    assert "no_such_field" in line and "metadata" in line and "service_tier" in line
    assert "store" in line  # not implemented, and sent other than its default (null)
    assert log_lines(server, plain.id) and not [
        line for line in log_lines(server, plain.id) if "WARNING" in line
    ]


@pytest.mark.parametrize(
    ("path", "field", "value", "says"),
    [
        ("/v1/chat/completions", "echo", True, "not supported yet"),
        ("/v1/completions", "suffix", "    return x", "no fill-in-the-middle tokens"),
        ("/v1/chat/completions", "use_beam_search", True, "not supported yet"),
        ("/v1/chat/completions", "best_of", 2, "best_of must be None or equal to n"),
        # Declared fields keep their types, implemented or not.
        ("/v1/completions", "echo", "yes", "boolean"),
        ("/v1/chat/completions", "chat_template_kwargs", "enable_thinking", "dictionary"),
        ("/v1/chat/completions", "stream_options", {"continuous_usage_stats": 1}, "boolean"),
    ],
)
def test_fields_changing_the_reply_and_bad_values_are_400_naming_them(
    server: RemoteServer, path: str, field: str, value, says: str
) -> None:
    base = {"model": NAME, "max_tokens": 2}
    base.update({"prompt": "Hi"} if path == "/v1/completions" else {"messages": HI})
    error = error_of(post(server, path, {**base, field: value}), field)
    assert says in error["message"], error


# ---- continuous_usage_stats ----------------------------------------------------------------------


def stream_chunks(server: RemoteServer, path: str, body: dict) -> list[dict]:
    chunks = []
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", server.url(path), json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: ") :]))
    return chunks


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_put_usage_in_every_chunk(
    server: RemoteServer, tokenizer, path: str
) -> None:
    chat = path.endswith("chat/completions")
    prompt = {"messages": HI} if chat else {"prompt": "The cat"}
    prompt_len = ok(post(server, "/tokenize", prompt))["count"]
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"model": NAME, **prompt, "max_tokens": 6, **GREEDY, "stream": True}
    chunks = stream_chunks(server, path, {**body, "stream_options": options})
    assert all(c["usage"] is not None for c in chunks)
    assert {c["usage"]["prompt_tokens"] for c in chunks} == {prompt_len}
    done = [c["usage"]["completion_tokens"] for c in chunks]
    # Counts so far, not the final count copied into every chunk.
    assert done == sorted(done) and done[0] < done[-1] == 6
    assert all(
        c["usage"]["total_tokens"] == prompt_len + d for c, d in zip(chunks, done, strict=True)
    )
    if chat:  # the opening chunk (the assistant role) already knows the prompt
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant" and done[0] == 0
    assert chunks[-1]["choices"] == []
    # Without it, only the final chunk carries usage.
    plain = stream_chunks(server, path, {**body, "stream_options": {"include_usage": True}})
    assert [c["usage"] is not None for c in plain] == [False] * (len(plain) - 1) + [True]
    assert plain[-1]["usage"] == chunks[-1]["usage"]


# ---- the reasoning parser ----------------------------------------------------------------------


def test_deepseek_r1_reply_is_reasoning_streamed_or_not(
    server: RemoteServer, client: OpenAI
) -> None:
    """The tiny model never writes </think>, so deepseek_r1 reads the whole reply as
    reasoning that was cut off: the completion of the same prompt tokens, trimmed."""
    prompt_ids = ok(post(server, "/tokenize", {"messages": HI}))["tokens"]
    text = completion_text(server, prompt_ids, 10)
    assert "</think>" not in text and text.strip()
    kwargs = {"model": NAME, "messages": HI, "max_tokens": 10, "extra_body": {"ignore_eos": True}}
    reply = client.chat.completions.create(**kwargs, temperature=0.0)
    message = reply.choices[0].message
    assert message.reasoning_content == text.strip() and message.content is None
    stream = client.chat.completions.create(**kwargs, temperature=0.0, stream=True)
    deltas = [c.choices[0].delta for c in stream if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == text.strip()
    assert all(not d.content for d in deltas)
    hidden = client.chat.completions.create(
        **{**kwargs, "extra_body": {"ignore_eos": True, "include_reasoning": False}},
        temperature=0.0,
    )
    assert getattr(hidden.choices[0].message, "reasoning_content", None) is None


def test_guided_replies_are_content_not_reasoning(client: OpenAI) -> None:
    reply = client.chat.completions.create(
        model=NAME,
        messages=HI,
        max_tokens=8,
        temperature=0.0,
        response_format={"type": "json_object"},
    )
    message = reply.choices[0].message
    assert getattr(message, "reasoning_content", None) is None
    assert message.content and message.content.lstrip().startswith("{")


# ---- metrics and the access log ----------------------------------------------------------------

ALIASES = [  # (tokenwise sample, vllm sample, extra labels)
    ("tokenwise:num_requests_running", "vllm:num_requests_running", {}),
    ("tokenwise:num_requests_waiting", "vllm:num_requests_waiting", {}),
    ("tokenwise:kv_cache_usage_perc", "vllm:kv_cache_usage_perc", {}),
    ("tokenwise:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", {}),
    ("tokenwise:prefix_cache_queries_total", "vllm:prefix_cache_queries_total", {}),
    ("tokenwise:prefix_cache_hits_total", "vllm:prefix_cache_hits_total", {}),
    ("tokenwise:generation_tokens_total", "vllm:generation_tokens_total", {}),
    ("tokenwise:num_preemptions_total", "vllm:num_preemptions_total", {}),
    (
        "tokenwise:request_success_total",
        "vllm:request_success_total",
        {"finished_reason": "length"},
    ),
    ("tokenwise:time_to_first_token_seconds_count", "vllm:time_to_first_token_seconds_count", {}),
    ("tokenwise:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_sum", {}),
    (
        "tokenwise:time_to_first_token_seconds_bucket",
        "vllm:time_to_first_token_seconds_bucket",
        {"le": "1.0"},
    ),
    ("tokenwise:inter_token_latency_seconds_count", "vllm:inter_token_latency_seconds_count", {}),
    ("tokenwise:inter_token_latency_seconds_count", "vllm:time_per_output_token_seconds_count", {}),
    ("tokenwise:e2e_request_latency_seconds_sum", "vllm:e2e_request_latency_seconds_sum", {}),
]


def test_vllm_metric_names_alias_ours(server: RemoteServer) -> None:
    before = wait_for_idle(server)
    prompt = list(range(3, 43))  # 40 tokens: two full blocks of 16 can be reused
    for _ in range(2):
        completion_text(server, prompt, 3)
    text = wait_for_idle(server)
    for ours, theirs, labels in ALIASES:
        assert metric_value(text, theirs, model_name=NAME, **labels) == metric_value(
            text, ours, model_name=NAME, **labels
        ), theirs
    assert metric_value(text, "vllm:generation_tokens_total", model_name=NAME) > 0
    assert metric_value(text, "vllm:time_to_first_token_seconds_count", model_name=NAME) > 0

    def grew(name: str) -> float:
        return metric_value(text, name, model_name=NAME) - metric_value(
            before, name, model_name=NAME
        )

    # vLLM's prompt_tokens counts whole prompts; ours computed tokens, cache hits excluded.
    assert grew("vllm:prompt_tokens_total") == 80
    assert grew("tokenwise:prompt_tokens_total") + grew("tokenwise:prefix_cache_hits_total") == 80
    assert grew("tokenwise:prefix_cache_hits_total") == 32


def test_router_metrics_parse_as_prometheus_text(server: RemoteServer) -> None:
    """What llm-d's scheduler scrapes, read with prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(server.metrics())}
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running"):
        (sample,) = families[name].samples
        assert families[name].type == "gauge" and sample.labels == {"model_name": NAME}
        assert sample.value >= 0
    (usage,) = families["vllm:kv_cache_usage_perc"].samples
    assert 0.0 <= usage.value <= 1.0
    (info,) = families["vllm:cache_config_info"].samples
    (total,) = families["tokenwise:num_total_kv_blocks"].samples
    assert info.value == 1.0
    assert info.labels["block_size"] == "16" and info.labels["cache_dtype"] == "auto"
    assert info.labels["enable_prefix_caching"] == "True"
    assert int(info.labels["num_gpu_blocks"]) == total.value > 0
    assert "vllm:lora_requests_info" not in families  # LoRA is off (as vLLM: no series)


def test_access_log_has_one_line_per_http_request(server: RemoteServer, client: OpenAI) -> None:
    reply = client.chat.completions.create(model=NAME, messages=HI, max_tokens=5, temperature=0.0)
    (line,) = log_lines(server, f"id={reply.id} ")
    usage = reply.usage
    assert re.search(
        rf'"POST /v1/chat/completions" 200 id={reply.id} prompt_tokens={usage.prompt_tokens} '
        rf"output_tokens={usage.completion_tokens} time=\d+\.\d{{3}}s$",
        line,
    ), line
    stream = client.completions.create(
        model=NAME, prompt="Hello", max_tokens=4, stream=True, extra_body={"ignore_eos": True}
    )
    chunk_ids = {chunk.id for chunk in stream}
    (stream_id,) = chunk_ids
    (line,) = log_lines(server, f"id={stream_id} ")
    assert "200" in line and "output_tokens=4" in line
    response = httpx.get(server.url("/no/such/route"), timeout=10)
    assert response.status_code == 404
    assert log_lines(server, '"GET /no/such/route" 404 id=')
    error_of(
        post(server, "/v1/completions", {"model": NAME, "prompt": "x", "suffix": "y"}), "suffix"
    )
    lines = log_lines(server, '"POST /v1/completions" 400 id=cmpl-')
    assert lines and "output_tokens" not in lines[-1]  # refused before any token was counted
