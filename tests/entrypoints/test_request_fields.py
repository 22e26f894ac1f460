"""Lenient request bodies (`request_fields`), without a server: unknown fields at any depth are
found and named in one warning, `--strict-request-fields` refuses them by name, fields that
would change the reply are refused unless their value is a no-op, and harmless ones are
ignored with the warning. Over HTTP: test_server_api_extras.py and test_server_errors.py."""

from __future__ import annotations

import logging

import pytest
from pydantic import BaseModel, ValidationError

from tokenwise.entrypoints.openai.errors import OpenAIError
from tokenwise.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from tokenwise.entrypoints.openai.protocol_embeddings import EmbeddingRequest
from tokenwise.entrypoints.openai.protocol_responses import ResponsesRequest
from tokenwise.entrypoints.openai.protocol_tokenization import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from tokenwise.entrypoints.openai.request_fields import (
    IGNORED,
    REFUSED,
    accept_fields,
    unknown_fields,
)

MESSAGES = [{"role": "user", "content": "Hi", "name": "ann"}]  # `name`: for the template
LOGGER = "tokenwise.server"


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MESSAGES, **fields})


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "Hi", **fields})


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_unknown_fields_at_any_depth_are_named_in_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    body = chat(
        foo=1,
        stream_options={"include_usage": True, "bar": True},
        tools=[{"type": "function", "function": {"name": "f", "baz": 0}}],
        messages=[*MESSAGES, {"role": "user", "content": [{"type": "text", "text": "x", "q": 1}]}],
    )
    assert unknown_fields(body) == [
        "foo",
        "messages.1.content.0.q",
        "tools.0.function.baz",
        "stream_options.bar",
    ]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        accept_fields(body, strict=False, request_id="chatcmpl-1", route="/v1/chat/completions")
    (line,) = warnings_of(caplog)
    assert "chatcmpl-1" in line and "/v1/chat/completions" in line
    for path in ("foo", "messages.1.content.0.q", "tools.0.function.baz", "stream_options.bar"):
        assert path in line
    assert "ann" not in line and "name" not in line  # message keys are the template's


def test_strict_mode_refuses_the_unknown_field_by_name() -> None:
    with pytest.raises(OpenAIError) as info:
        accept_fields(completion(max_token=5), strict=True, request_id="r", route="/x")
    assert info.value.status_code == 400 and info.value.param == "max_token"
    assert "max_token" in info.value.message and "--strict-request-fields" in info.value.message
    nested = chat(stream_options={"include_usage": True, "typo": 1})
    with pytest.raises(OpenAIError) as info:
        accept_fields(nested, strict=True, request_id="r", route="/x")
    assert info.value.param == "stream_options" and "stream_options.typo" in info.value.message


@pytest.mark.parametrize(
    ("make", "field", "value"),
    [
        (chat, "echo", True),  # vLLM's chat echo (the last message) is not built
        (chat, "use_beam_search", True),  # completions only (serving_beam_search)
        (chat, "chat_template", "{{ messages }}"),
    ],
)
def test_fields_that_would_change_the_reply_are_refused(make, field: str, value) -> None:
    for strict in (False, True):
        with pytest.raises(OpenAIError) as info:
            accept_fields(make(**{field: value}), strict=strict, request_id="r", route="/x")
        error = info.value
        assert (error.status_code, error.param, error.code) == (400, field, "unsupported_parameter")
        assert error.message.startswith(f"{field} is not supported yet")


def test_no_op_values_of_refused_fields_pass_without_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    bodies = [
        completion(echo=False, suffix=""),
        completion(n=2, use_beam_search=False),
        chat(echo=False, chat_template=None),
    ]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for body in bodies:
            accept_fields(body, strict=True, request_id="r", route="/x")
    assert warnings_of(caplog) == []


def test_implemented_fields_pass_without_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """Once refused, now implemented: their values reach SamplingParams, which judges them."""
    bodies = [
        completion(echo=True, logprobs=1, max_tokens=0, prompt_logprobs=2, best_of=3),
        completion(logit_bias={"5": 100.0}, allowed_token_ids=[1, 2], truncate_prompt_tokens=8),
        chat(bad_words=["no"], prompt_logprobs=1, logit_bias={"7": -100.0}),
    ]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for body in bodies:
            accept_fields(body, strict=True, request_id="r", route="/x")
    assert warnings_of(caplog) == []
    assert REFUSED.keys().isdisjoint(
        {"logit_bias", "prompt_logprobs", "best_of", "allowed_token_ids", "bad_words"}
    )


def test_beam_search_knobs_are_used_with_beam_search_and_ignored_without(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        body = completion(use_beam_search=True, length_penalty=2.0, early_stopping=True)
        accept_fields(body, strict=True, request_id="r", route="/x")
        assert warnings_of(caplog) == []
        accept_fields(completion(length_penalty=2.0), strict=True, request_id="r", route="/x")
        accept_fields(chat(early_stopping=True), strict=True, request_id="r", route="/x")
    first, second = warnings_of(caplog)
    assert "not implemented length_penalty" in first and "early_stopping" in second


def test_harmless_fields_are_ignored_with_the_warning(caplog: pytest.LogCaptureFixture) -> None:
    body = chat(
        metadata={"team": "a"},
        store=True,
        service_tier="auto",
        reasoning_effort="low",  # implemented: a template variable
        priority=3,  # implemented (the engine refuses it unless it schedules by priority)
        length_penalty=1.0,  # the default: not worth a warning
        user="u1",  # OpenAI's end-user id: nothing to implement
        parallel_tool_calls=False,  # implemented
    )
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        accept_fields(body, strict=True, request_id="r", route="/x")  # known: strict passes
    (line,) = warnings_of(caplog)
    for name in ("metadata", "store", "service_tier"):
        assert name in line
    for name in ("length_penalty", "user", "parallel_tool_calls", "priority", "reasoning_effort"):
        assert name not in line


def test_responses_implement_store_and_metadata(caplog: pytest.LogCaptureFixture) -> None:
    """Ignored by chat, implemented by the Responses endpoint: no warning there."""
    body = ResponsesRequest.model_validate(
        {"input": "Hi", "store": False, "metadata": {"a": "b"}, "prompt_cache_key": "k"}
    )
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        accept_fields(body, strict=True, request_id="r", route="/x")
    (line,) = warnings_of(caplog)
    assert "prompt_cache_key" in line and "store" not in line and "metadata" not in line


@pytest.mark.parametrize(
    ("make", "fields", "where"),
    [
        (completion, {"echo": "yes"}, "echo"),
        (completion, {"logit_bias": {"5": "high"}}, "logit_bias"),
        (completion, {"best_of": 2.5}, "best_of"),
        (chat, {"stream_options": {"continuous_usage_stats": "yes"}}, "stream_options"),
        (chat, {"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
        (chat, {"include_reasoning": 1}, "include_reasoning"),
        (completion, {"add_special_tokens": "false"}, "add_special_tokens"),
    ],
)
def test_declared_fields_keep_their_types(make, fields, where: str) -> None:
    with pytest.raises(ValidationError) as info:
        make(**fields)
    assert info.value.errors()[0]["loc"][0] == where


def test_field_lists_name_declared_request_fields() -> None:
    models: list[type[BaseModel]] = [
        CompletionRequest,
        ChatCompletionRequest,
        EmbeddingRequest,
        TokenizeCompletionRequest,
        TokenizeChatRequest,
        DetokenizeRequest,
        ResponsesRequest,
    ]
    declared = set().union(*(m.model_fields for m in models))
    assert set(IGNORED) <= declared
    assert set(REFUSED) <= declared
    assert not set(IGNORED) & set(REFUSED)
