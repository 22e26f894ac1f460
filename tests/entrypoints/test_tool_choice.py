"""Every `tool_choice` form, OpenAI's `allowed_tools` included, and vLLM's
`structured_outputs` field with `disable_any_whitespace`, as the chat endpoint resolves them:
which tools the template and the grammar see, which JSON the grammar accepts, and a 400
naming the field for each bad form."""

from __future__ import annotations

from typing import Any

import pytest
from xgrammar.testing import _is_grammar_accept_string as accepts

from tests.entrypoints.tool_call_samples import TOOLS
from tokenwise.entrypoints.openai.errors import OpenAIError
from tokenwise.entrypoints.openai.protocol import ChatCompletionRequest
from tokenwise.entrypoints.openai.structured_outputs import (
    guided_decoding_for,
    is_guided,
    narrow_allowed_tools,
    resolve_tool_mode,
)
from tokenwise.sampling.guided.grammar import build_grammar
from tokenwise.sampling.guided.params import GuidedDecodingParams

THIRD = {"type": "function", "function": {"name": "third", "parameters": {"type": "object"}}}


def request(**fields: Any) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [*TOOLS, THIRD], **fields}
    return ChatCompletionRequest.model_validate(body)


def allowed(mode: str, *names: str) -> dict[str, Any]:
    tools = [{"type": "function", "function": {"name": n}} for n in names]
    return {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": tools}}


def test_allowed_tools_narrow_the_tools_and_act_as_their_mode() -> None:
    body = narrow_allowed_tools(request(tool_choice=allowed("auto", "third", "get_weather")))
    assert [t.function.name for t in body.tools] == ["get_weather", "third"]  # tools' order
    assert body.tool_choice == "auto" and resolve_tool_mode(body).kind == "auto"
    raw = request(tool_choice=allowed("required", "convert"))
    assert resolve_tool_mode(raw).kind == "required" and is_guided(raw, resolve_tool_mode(raw))
    spec = guided_decoding_for(raw, resolve_tool_mode(raw))
    assert spec is not None
    names = [item["properties"]["name"]["enum"] for item in spec.json["items"]["anyOf"]]
    assert names == [["convert"]]  # the grammar offers only the allowed tool
    grammar = build_grammar(spec)
    assert accepts(grammar, '[{"name": "convert", "arguments": {"amount": 5}}]')
    assert not accepts(grammar, '[{"name": "third", "arguments": {}}]')


def test_other_tool_choice_forms_are_unchanged() -> None:
    for choice in ("none", "auto", "required", {"type": "function", "function": {"name": "third"}}):
        body = request(tool_choice=choice)
        assert narrow_allowed_tools(body) is body
    assert resolve_tool_mode(request()).kind == "auto"
    named = resolve_tool_mode(
        request(tool_choice={"type": "function", "function": {"name": "third"}})
    )
    assert (named.kind, named.name) == ("named", "third")


def test_allowed_tool_not_in_tools_is_a_400_naming_it() -> None:
    with pytest.raises(OpenAIError) as info:
        resolve_tool_mode(request(tool_choice=allowed("auto", "convert", "nope")))
    assert info.value.status_code == 400 and info.value.param == "tool_choice"
    assert "tool_choice.allowed_tools.tools[1]" in str(info.value) and "'nope'" in str(info.value)


@pytest.mark.parametrize(
    "choice",
    [
        {"type": "allowed_tools", "allowed_tools": {"mode": "sometimes", "tools": []}},
        {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}},
        {"type": "allowed_tools", "mode": "auto"},
        {"type": "custom", "custom": {"name": "x"}},
    ],
)
def test_bad_tool_choice_forms_fail_validation_on_tool_choice(choice: dict) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as info:
        request(tool_choice=choice)
    assert all(err["loc"][0] == "tool_choice" for err in info.value.errors())


def test_disable_any_whitespace_fixes_the_json_layout_of_a_forced_call() -> None:
    forced = {"type": "function", "function": {"name": "convert"}}
    loose = guided_decoding_for(
        request(tool_choice=forced), resolve_tool_mode(request(tool_choice=forced))
    )
    body = request(tool_choice=forced, structured_outputs={"disable_any_whitespace": True})
    compact = guided_decoding_for(body, resolve_tool_mode(body))
    assert loose is not None and compact is not None and compact.disable_any_whitespace
    assert loose.cache_key() != compact.cache_key()  # compiled apart
    tight, free = build_grammar(compact), build_grammar(loose)
    assert accepts(tight, '{"amount": 5}') and accepts(free, '{"amount": 5}')
    for spaced in ('{"amount":  5}', '{ "amount": 5}', '{\n"amount": 5}'):
        assert accepts(free, spaced) and not accepts(tight, spaced)


def test_structured_outputs_field_is_one_more_source() -> None:
    body = request(structured_outputs={"json": {"type": "object"}, "disable_any_whitespace": True})
    spec = guided_decoding_for(body)
    assert spec is not None and spec.json == {"type": "object"} and spec.disable_any_whitespace
    assert is_guided(body) and not is_guided(request(structured_outputs={}))
    spec = guided_decoding_for(request(structured_outputs={"choice": ["a", "b"]}))
    assert spec is not None and spec.choice == ["a", "b"]
    for fields, param in (
        ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a+"}, "guided_json": {}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "("}}, "structured_outputs"),
    ):
        with pytest.raises(OpenAIError) as info:
            guided_decoding_for(request(**fields))
        assert info.value.status_code == 400 and info.value.param == param
        assert str(info.value).startswith(("structured_outputs", "at most one"))


def test_offline_params_take_disable_any_whitespace() -> None:
    spec = GuidedDecodingParams(json_object=True, disable_any_whitespace=True)
    assert not accepts(build_grammar(spec), '{"a": 1 }') and accepts(
        build_grammar(spec), '{"a": 1}'
    )
    with pytest.raises(ValueError, match="disable_any_whitespace must be a bool"):
        GuidedDecodingParams(json_object=True, disable_any_whitespace="yes")  # type: ignore[arg-type]


def test_responses_allowed_tools_run_as_chats_form() -> None:
    from tokenwise.entrypoints.openai.protocol_responses import ResponsesRequest
    from tokenwise.entrypoints.openai.responses_input import chat_request, forces_call

    tools = [
        {
            "type": "function",
            "name": t["function"]["name"],
            "parameters": t["function"]["parameters"],
        }
        for t in TOOLS
    ]
    for mode in ("auto", "required"):
        body = ResponsesRequest.model_validate(
            {
                "input": "hi",
                "tools": tools,
                "tool_choice": {
                    "type": "allowed_tools", "mode": mode,
                    "tools": [{"type": "function", "name": "convert"}],
                },
            }
        )  # fmt: skip
        assert forces_call(body) == (mode == "required")
        chat = narrow_allowed_tools(chat_request(body, [{"role": "user", "content": "hi"}]))
        assert [t.function.name for t in chat.tools] == ["convert"] and chat.tool_choice == mode
