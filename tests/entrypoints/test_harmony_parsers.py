"""gpt-oss's harmony format read by `--reasoning-parser openai_gptoss` and `--tool-call-parser
openai` on hand-written replies: headers in the forms the model writes, the split into
reasoning, content and calls, the same split from a stream cut at every position (special
tokens cut in half included) or as the engine's detokenizer sends it token by token, and
replies cut off by max_tokens read without an error."""

from __future__ import annotations

import json
import random

import pytest

from tests.entrypoints.harmony_samples import ANSWER, CALL, SAMPLES, harmony_tokenizer
from tokenwise.engine.detokenizer import IncrementalDetokenizer
from tokenwise.entrypoints.openai.protocol import DeltaMessage
from tokenwise.entrypoints.openai.reasoning import (
    REASONING_PARSERS,
    GptOssReasoningParser,
    split_reasoning,
)
from tokenwise.entrypoints.openai.structured_outputs import ToolMode
from tokenwise.entrypoints.openai.tool_calls import ToolCallReader, parse_tool_calls
from tokenwise.entrypoints.openai.tool_parsers import TOOL_PARSERS
from tokenwise.entrypoints.openai.tool_parsers.harmony import (
    Body,
    HarmonyLexer,
    MessageEnd,
    MessageStart,
    Outside,
    parse_header,
)


def reader(mode: str = "auto") -> ToolCallReader:
    return ToolCallReader(ToolMode(mode), GptOssReasoningParser(), True, TOOL_PARSERS["openai"]())


def streamed(pieces: list[str], finish: str = "stop") -> tuple[str, str, list, str | None]:
    """(reasoning, content, calls as (name, arguments), finish reason) of a stream."""
    r = reader()
    reasoning = content = ""
    calls: list[list[str]] = []
    reason = None
    for i, piece in enumerate(pieces + [""]):
        delta, reason = r.delta(piece, finish if i == len(pieces) else None)
        delta = delta or DeltaMessage()
        reasoning += delta.reasoning_content or ""
        content += delta.content or ""
        for call in delta.tool_calls or []:
            if call.function.name is not None:
                assert call.index == len(calls) and call.id
                calls.append([call.function.name, ""])
            calls[call.index][1] += call.function.arguments or ""
    return reasoning, content, [tuple(c) for c in calls], reason


def splits(text: str) -> list[list[str]]:
    """The text cut once at every position, character by character, and at random places."""
    out = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    rng = random.Random(len(text))
    for _ in range(30):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, 5)))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return out


def test_headers_in_every_form_the_model_writes() -> None:
    start = parse_header(
        "<|channel|>commentary to=functions.f <|constrain|>json<|message|>", "assistant"
    )
    assert (start.role, start.channel, start.recipient, start.content_type) == (
        "assistant", "commentary", "functions.f", "json"
    )  # fmt: skip
    start = parse_header("assistant to=functions.g<|channel|>commentary json<|message|>", "x")
    assert (start.role, start.channel, start.recipient, start.content_type) == (
        "assistant", "commentary", "functions.g", "json"
    )  # fmt: skip
    start = parse_header("<|channel|>final<|message|>", "assistant")
    assert (start.channel, start.recipient, start.content_type) == ("final", None, None)


def test_lexer_events_keep_the_text_as_written() -> None:
    lexer = HarmonyLexer()
    events = lexer.feed("hi <|start|>assistant<|channel|>final<|message|>a<|e") + lexer.feed(
        "nd|>b<|chan"
    )
    events += lexer.finish()
    assert [type(e) for e in events[:4]] == [Outside, MessageStart, Body, MessageEnd]
    assert events[1].raw == "<|start|>assistant<|channel|>final<|message|>"
    assert (events[2].text, events[3].marker) == ("a", "<|end|>")
    # After the message: outside again; a partial token is released as text once none can come.
    assert all(isinstance(e, Outside) for e in events[4:])
    assert "".join(e.text for e in events[4:]) == "b<|chan"


@pytest.mark.parametrize(("text", "reasoning", "content", "calls"), SAMPLES)
def test_whole_reply(text: str, reasoning, content, calls) -> None:
    message, finish = reader().message(text, "stop")
    assert message.reasoning_content == reasoning
    assert message.content == content
    got = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    assert got == calls
    for _, arguments in got:
        json.loads(arguments)
    assert finish == ("tool_calls" if calls else "stop")


@pytest.mark.parametrize(("text", "reasoning", "content", "calls"), SAMPLES)
def test_streamed_at_every_split_equals_whole(text: str, reasoning, content, calls) -> None:
    want_content = content or ""
    for pieces in splits(text):
        got_reasoning, got_content, got_calls, finish = streamed(pieces)
        assert got_reasoning == (reasoning or ""), pieces
        # A stream cannot unsend whitespace, which a collected reply with calls trims.
        assert (got_content.strip() if calls else got_content) == want_content, pieces
        assert got_calls == calls, pieces
        assert finish == ("tool_calls" if calls else "stop")


def test_reasoning_parser_alone_passes_calls_on_as_harmony() -> None:
    reasoning, content = split_reasoning(REASONING_PARSERS["openai_gptoss"](), CALL)
    assert reasoning == "Need the weather: call get_weather."
    assert content is not None and content.startswith("<|start|>assistant<|channel|>commentary")
    assert split_reasoning(GptOssReasoningParser(), ANSWER)[1] == "Hello! How can I help?"


def test_tool_parser_alone_leaves_the_reasoning_out() -> None:
    result = parse_tool_calls(ANSWER, "openai")
    assert (result.content, result.calls) == ("Hello! How can I help?", [])
    result = parse_tool_calls(CALL, "openai")
    assert [(c.name, json.loads(c.arguments)) for c in result.calls] == [
        ("get_weather", {"city": "Paris", "days": 3})
    ]
    message, _ = ToolCallReader(ToolMode("auto"), parser=TOOL_PARSERS["openai"]()).message(
        ANSWER, "stop"
    )
    assert (message.content, message.reasoning_content) == ("Hello! How can I help?", None)


def test_reply_cut_off_by_max_tokens_keeps_what_was_written() -> None:
    """An unterminated call at max_tokens: its name and the arguments so far, finish "length"
    (not "tool_calls": the call is incomplete); inside a header: nothing is made of it."""
    cut = CALL[: CALL.index('"days"')]
    message, finish = reader().message(cut, "length")
    assert finish == "length"
    assert message.tool_calls[0].function.name == "get_weather"
    assert message.tool_calls[0].function.arguments == '{"city": "Paris", '
    assert streamed([cut[:50], cut[50:]], "length")[2:] == (
        [("get_weather", '{"city": "Paris", ')], "length"
    )  # fmt: skip
    header_cut = CALL[: CALL.index("<|constrain|>")]
    message, finish = reader().message(header_cut, "length")
    assert (message.content, message.tool_calls, finish) == (None, None, "length")


def test_without_tools_the_answer_is_plain_content() -> None:
    message, _ = reader("none").message(ANSWER, "stop")
    assert (message.reasoning_content, message.content) == (
        "The user greets me. Reply briefly.", "Hello! How can I help?"
    )  # fmt: skip


def test_harmony_parsers_ask_for_special_tokens() -> None:
    assert REASONING_PARSERS["openai_gptoss"].needs_special_tokens
    assert not REASONING_PARSERS["qwen3"].needs_special_tokens
    assert TOOL_PARSERS["openai"].needs_special_tokens


@pytest.mark.parametrize("text", [ANSWER, CALL])
def test_detokenized_token_by_token_with_special_tokens_kept(text: str) -> None:
    """Through the engine's incremental detokenizer, as a served reply arrives: each harmony
    token is one token whose text is kept whole, so the parsers read what they read above."""
    tok = harmony_tokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.convert_tokens_to_ids("<|message|>") in ids
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    pieces = []
    for token in ids:
        detok.add_token(token)
        pieces.append(detok.take_new_text(finished=False))
    pieces.append(detok.take_new_text(finished=True))
    assert "".join(pieces) == text
    message, _ = reader().message(text, "stop")
    want = (message.reasoning_content or "", message.content or "")
    got = streamed(pieces)
    assert (got[0], got[1].strip()) == want
    assert got[2] == [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
