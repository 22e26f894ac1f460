"""`tool_choice="auto"` parsers (`--tool-call-parser`), one per model family, on hand-written
replies: the content and calls read out of a whole reply, and the same reply streamed cut at
every character position giving exactly the same content and calls, in OpenAI's delta shape
(each call's first piece carries its index, id and name; later pieces only arguments)."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from tests.entrypoints.tool_call_samples import SAMPLES, TOOLS
from tokenwise.entrypoints.openai.protocol import DeltaMessage
from tokenwise.entrypoints.openai.structured_outputs import ToolMode
from tokenwise.entrypoints.openai.tool_calls import (
    ToolCallReader,
    parse_call_array,
    parse_tool_calls,
)
from tokenwise.entrypoints.openai.tool_parsers import TOOL_PARSERS, check_tool_call_parser

IDS = [f"{name}-{i}" for i, (name, *_) in enumerate(SAMPLES)]


def reader(parser: str) -> ToolCallReader:
    return ToolCallReader(ToolMode("auto"), parser=TOOL_PARSERS[parser](TOOLS))


def collect(parser: str, pieces: list[str]) -> tuple[str, list[dict[str, Any]], str | None]:
    """Stream `pieces` through a reader: (content, calls by index, finish reason), checking
    each delta's shape on the way."""
    r, deltas = reader(parser), []
    for piece in pieces:
        delta, finish = r.delta(piece, None)
        assert finish is None
        if delta is not None:
            deltas.append(delta)
    last, finish = r.delta("", "stop")
    deltas.append(last or DeltaMessage())
    content, calls = "", []
    for delta in deltas:
        content += delta.content or ""
        seen = set()
        for p in delta.tool_calls or []:
            assert p.index not in seen, "a call appears once per delta"
            seen.add(p.index)
            if p.index == len(calls):  # a new call: id, type and name come first
                assert p.id and p.id.startswith("call_") and p.type == "function"
                assert p.function.name
                calls.append({"id": p.id, "name": p.function.name, "arguments": ""})
            else:
                assert p.index == len(calls) - 1, "pieces of earlier calls never come back"
                assert p.id is None and p.function.name is None
            calls[p.index]["arguments"] += p.function.arguments or ""
    return content, calls, finish


@pytest.mark.parametrize(("parser", "text", "content", "calls"), SAMPLES, ids=IDS)
def test_whole_reply(parser: str, text: str, content: str | None, calls: list) -> None:
    result = parse_tool_calls(text, parser, TOOLS)
    assert [(c.name, json.loads(c.arguments)) for c in result.calls] == calls
    assert result.content == (content or "")
    message, finish = reader(parser).message(text, "stop")
    assert finish == ("tool_calls" if calls else "stop")
    assert message.content == (content if calls else text)
    assert len(message.tool_calls or []) == len(calls)


@pytest.mark.parametrize(("parser", "text", "content", "calls"), SAMPLES, ids=IDS)
def test_streamed_at_every_split_equals_whole(
    parser: str, text: str, content: str | None, calls: list
) -> None:
    message, _ = reader(parser).message(text, "stop")
    want_calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    want_content = message.content or ""
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    rng = random.Random(len(text))
    for _ in range(20):  # and cut in several places at once
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(2, 9))))
        splits.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    for pieces in splits:
        got_content, got_calls, finish = collect(parser, pieces)
        assert [(c["name"], c["arguments"]) for c in got_calls] == want_calls, pieces
        # A collected reply with calls trims the content around them; a stream cannot
        # unsend whitespace, so only trimming is allowed to differ.
        got = got_content.strip() if want_calls else got_content
        assert got == want_content, pieces
        assert finish == ("tool_calls" if want_calls else "stop")


def test_arguments_stream_in_pieces_as_they_arrive() -> None:
    """Formats that name a call before its arguments send the name first, then the
    arguments piece by piece (not only once the call is complete)."""
    args = '{"city": "Paris", "days": 3}'
    for parser, text in (
        ("mistral", f"[TOOL_CALLS]get_weather[ARGS]{args}"),
        ("hermes", f'<tool_call>{{"name": "get_weather", "arguments": {args}}}</tool_call>'),
        ("llama3_json", f'{{"name": "get_weather", "parameters": {args}}}'),
    ):
        r = reader(parser)
        first, _ = r.delta(text[: text.index(", ", text.index("city"))], None)
        assert first is not None and first.tool_calls is not None, parser
        assert first.tool_calls[0].function.name == "get_weather"
        assert first.tool_calls[0].function.arguments == '{"city": "Paris"', parser
    xml = "<tool_call>\n<function=convert>\n<parameter=amount>\n5\n</parameter>\n"
    r = reader("qwen3_coder")
    delta, _ = r.delta(xml, None)
    assert delta is not None and [p.function.arguments for p in delta.tool_calls] == [
        '{"amount": 5'
    ]


def test_llama3_python_tag_partial_is_held_then_released_as_content() -> None:
    r = reader("llama3_json")
    assert r.delta("<|pyth", None)[0] is None
    delta, _ = r.delta("on is great", None)
    assert delta is not None and delta.content == "<|python is great"


def test_unknown_parser_and_auto_choice_without_parser_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown tool call parser 'llama'.*llama3_json"):
        check_tool_call_parser("llama")
    with pytest.raises(ValueError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        check_tool_call_parser(None, enable_auto_tool_choice=True)
    check_tool_call_parser("pythonic", enable_auto_tool_choice=True)
    assert sorted(TOOL_PARSERS) == [
        "deepseek_v3", "hermes", "llama3_json", "mistral", "openai", "pythonic", "qwen3_coder"
    ]  # fmt: skip


def test_length_cut_replies_keep_their_finish_reason() -> None:
    message, finish = ToolCallReader(ToolMode("named", "f")).message('{"a": 1', "length")
    assert finish == "length" and message.tool_calls[0].function.arguments == '{"a": 1'
    message, finish = ToolCallReader(ToolMode("required")).message('[{"name": "f"', "length")
    assert finish == "length" and message.tool_calls is None and message.content == '[{"name": "f"'


def test_required_array_parsing() -> None:
    calls = parse_call_array(
        '[{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]'
    )
    assert [(c.name, json.loads(c.arguments)) for c in calls or []] == [("f", {"a": 1}), ("g", {})]
    assert parse_call_array('{"name": "f"}') is None and parse_call_array("[1]") is None


def test_serve_flags_reach_the_server_config(capsys: pytest.CaptureFixture[str]) -> None:
    from tokenwise.entrypoints.cli import build_parser
    from tokenwise.entrypoints.openai.cli_args import server_config_kwargs
    from tokenwise.entrypoints.openai.server_config import ServerConfig

    parser = build_parser()
    args = parser.parse_args(
        ["serve", "--tool-call-parser", "qwen3_coder", "--enable-auto-tool-choice"]
    )
    config = ServerConfig("m", 64, **server_config_kwargs(args))
    assert (config.tool_call_parser, config.enable_auto_tool_choice) == ("qwen3_coder", True)
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--tool-call-parser", "llama3"])
    assert "invalid choice: 'llama3'" in capsys.readouterr().err
    args = parser.parse_args(["serve", "--enable-auto-tool-choice"])
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        ServerConfig("m", 64, **server_config_kwargs(args))
