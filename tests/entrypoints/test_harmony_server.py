"""gpt-oss's harmony format through the server, without a model: an in-process app whose engine
answers with a fixed harmony reply (`--reasoning-parser openai_gptoss --tool-call-parser
openai`), read back as chat completions (reasoning_content, content, tool_calls; collected and
streamed) and as Responses (reasoning and function_call items; collected and streamed); the
prompt rendered by a harmony chat template with the request's reasoning effort, earlier calls
and their reasoning; a reply cut off by max_tokens; gpt-oss's stop tokens, and the parsers it
gets by default."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Any

import pytest

from tests.entrypoints._recording_engine import NAME, app_for
from tests.entrypoints.harmony_samples import ANSWER, CALL, harmony_tokenizer
from tokenwise.engine.prompts import resolve_eos_token_ids
from tokenwise.entrypoints.openai.server_config import with_family_parsers

PARSERS = {"reasoning_parser": "openai_gptoss", "tool_call_parser": "openai"}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
# The Responses API's form of the same tool.
RESPONSES_TOOLS = [{"type": "function", **TOOLS[0]["function"]}]
USER = [{"role": "user", "content": "Weather in Paris?"}]
REASONING = "Need the weather: call get_weather."
ARGUMENTS = {"city": "Paris", "days": 3}


def pieces(text: str, size: int = 7) -> list[str]:
    """The reply in small pieces, special tokens cut in half among them."""
    return [text[i : i + size] for i in range(0, len(text), size)]


@pytest.fixture(scope="module")
def answer() -> Any:
    client, engine = app_for(harmony_tokenizer(), pieces(ANSWER), **PARSERS)
    with client:
        yield client, engine


@pytest.fixture(scope="module")
def call() -> Any:
    client, engine = app_for(harmony_tokenizer(), pieces(CALL), **PARSERS)
    with client:
        yield client, engine


def chat(client: Any, **extra: Any) -> Any:
    return client.post(
        "/v1/chat/completions", json={"model": NAME, "messages": USER, "max_tokens": 64, **extra}
    )


def chunks(text: str) -> list[dict[str, Any]]:
    """The chat stream's chunks (its data lines up to [DONE])."""
    lines = [line.removeprefix("data: ") for line in text.split("\n") if line.startswith("data:")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def events(text: str) -> list[dict[str, Any]]:
    """The Responses stream's events (their data)."""
    return [json.loads(line[6:]) for line in text.split("\n") if line.startswith("data: ")]


def test_chat_answer_splits_reasoning_from_content(answer: Any) -> None:
    client, engine = answer
    reply = chat(client).json()
    message = reply["choices"][0]["message"]
    assert message["reasoning_content"] == "The user greets me. Reply briefly."
    assert message["content"] == "Hello! How can I help?"
    assert reply["choices"][0]["finish_reason"] == "stop"
    # The parsers read special tokens, so the engine was asked to keep them.
    assert engine.params[-1].skip_special_tokens is False
    streamed = chunks(chat(client, stream=True).text)
    deltas = [c["choices"][0]["delta"] for c in streamed if c["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]
    assert not any("<|" in (d.get("content") or "") for d in deltas)


def test_chat_tool_call_collected_and_streamed(call: Any) -> None:
    client, _ = call
    reply = chat(client, tools=TOOLS).json()
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"] == REASONING
    assert choice["message"]["content"] is None
    (tool_call,) = choice["message"]["tool_calls"]
    assert tool_call["function"]["name"] == "get_weather"
    assert json.loads(tool_call["function"]["arguments"]) == ARGUMENTS
    streamed = chunks(chat(client, tools=TOOLS, stream=True).text)
    calls = [
        p
        for c in streamed
        if c["choices"]
        for p in c["choices"][0]["delta"].get("tool_calls") or []
    ]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert json.loads("".join(p["function"]["arguments"] or "" for p in calls)) == ARGUMENTS
    assert [c["choices"][0]["finish_reason"] for c in streamed if c["choices"]][-1] == "tool_calls"


def test_responses_reasoning_and_function_call_items(call: Any) -> None:
    client, engine = call
    body = {
        "model": NAME,
        "input": "Weather in Paris?",
        "tools": RESPONSES_TOOLS,
        "reasoning": {"effort": "high"},
    }
    reply = client.post("/v1/responses", json=body).json()
    assert reply["status"] == "completed"
    reasoning, function_call = reply["output"]
    assert reasoning["type"] == "reasoning"
    assert reasoning["content"] == [{"type": "reasoning_text", "text": REASONING}]
    assert function_call["type"] == "function_call" and function_call["name"] == "get_weather"
    assert json.loads(function_call["arguments"]) == ARGUMENTS
    assert function_call["call_id"].startswith("call_")
    assert "Reasoning: high" in engine.prompts[-1]["prompt"]
    stream = events(client.post("/v1/responses", json={**body, "stream": True}).text)
    types = [e["type"] for e in stream]
    assert "response.reasoning_text.delta" in types
    done = next(e for e in stream if e["type"] == "response.function_call_arguments.done")
    assert json.loads(done["arguments"]) == ARGUMENTS
    assert [i["type"] for i in stream[-1]["response"]["output"]] == ["reasoning", "function_call"]
    # The tool loop: the call's result sent back on the stored response; the next prompt shows
    # the model its call, the reasoning that led to it, and the result.
    output = {
        "type": "function_call_output",
        "call_id": function_call["call_id"],
        "output": "sunny",
    }
    follow = {**body, "input": [output], "previous_response_id": reply["id"]}
    assert client.post("/v1/responses", json=follow).status_code == 200
    text = engine.prompts[-1]["prompt"]
    call_text = f"<|message|>{json.dumps(ARGUMENTS)}<|call|>"
    assert f"<|channel|>analysis<|message|>{REASONING}<|end|>" in text
    assert text.index(REASONING) < text.index(call_text) < text.index("sunny")


def test_prompt_has_the_effort_special_tokens_and_earlier_calls(answer: Any) -> None:
    client, engine = answer
    assert chat(client).status_code == 200
    prompt = engine.prompts[-1]
    assert "Reasoning: medium" in prompt["prompt"]  # the template's default
    start_id = harmony_tokenizer().convert_tokens_to_ids("<|start|>")
    assert prompt["prompt_token_ids"].count(start_id) == prompt["prompt"].count("<|start|>") > 1
    assert chat(client, reasoning_effort="low").status_code == 200
    assert "Reasoning: low" in engine.prompts[-1]["prompt"]
    bad = chat(client, reasoning_effort="extreme")
    assert bad.status_code == 400 and "reasoning_effort" in bad.text
    # An earlier call, sent back as OpenAI writes it (arguments as JSON text, the reasoning
    # beside it), and its result: the template gets the arguments as an object.
    history = USER + [
        {"role": "assistant", "content": None, "reasoning_content": REASONING, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip
    assert chat(client, messages=history, tools=TOOLS).status_code == 200
    text = engine.prompts[-1]["prompt"]
    assert '<|message|>{"city": "Paris"}<|call|>' in text
    assert f"<|channel|>analysis<|message|>{REASONING}<|end|>" in text
    assert "namespace functions" in text and text.endswith("<|start|>assistant")


def test_reply_cut_off_inside_a_call_is_incomplete_not_an_error() -> None:
    cut = CALL[: CALL.index('"days"')]
    client, _ = app_for(harmony_tokenizer(), pieces(cut), finish_reason="length", **PARSERS)
    with client:
        reply = chat(client, tools=TOOLS)
        responses = client.post(
            "/v1/responses",
            json={"model": NAME, "input": "Weather?", "tools": RESPONSES_TOOLS},
        )
    assert reply.status_code == 200
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris", '
    assert responses.status_code == 200
    out = responses.json()
    assert out["status"] == "incomplete"
    assert out["incomplete_details"] == {"reason": "max_output_tokens"}
    assert out["output"][-1]["status"] == "incomplete"


def test_gpt_oss_stops_at_return_and_call(tmp_path: Any) -> None:
    tok = harmony_tokenizer()
    ret, call_id = tok.convert_tokens_to_ids(["<|return|>", "<|call|>"])
    gpt_oss = SimpleNamespace(model=str(tmp_path), hf_config=SimpleNamespace(model_type="gpt_oss"))
    assert {ret, call_id} <= set(resolve_eos_token_ids(gpt_oss, tok))  # type: ignore[arg-type]
    other = SimpleNamespace(model=str(tmp_path), hf_config=SimpleNamespace(model_type="llama"))
    assert call_id not in resolve_eos_token_ids(other, tok)  # type: ignore[arg-type]
    # The checkpoint's generation_config.json lists them for any family.
    with open(os.path.join(tmp_path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [ret, call_id]}, f)
    assert {ret, call_id} <= set(resolve_eos_token_ids(other, tok))  # type: ignore[arg-type]


def test_gpt_oss_gets_the_harmony_parsers_unless_flags_name_others() -> None:
    flags = {"reasoning_parser": None, "tool_call_parser": None, "api_key": None}
    assert with_family_parsers(flags, ["GptOssForCausalLM"]) == {**flags, **PARSERS}
    named = {**flags, "tool_call_parser": "hermes"}
    assert with_family_parsers(named, ["GptOssForCausalLM"])["tool_call_parser"] == "hermes"
    assert with_family_parsers(flags, ["LlamaForCausalLM"]) == flags
