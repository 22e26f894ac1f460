"""`--reasoning-parser deepseek_r1 | qwen3` on hand-written replies: the split into reasoning and
content, the same split from every way a stream can cut the reply (tags split across deltas
included), and tool calls read from the content after the reasoning only."""

from __future__ import annotations

import json
import random

import pytest

from tokenwise.entrypoints.openai.reasoning import (
    REASONING_PARSERS,
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningParser,
    check_reasoning_parser,
    split_reasoning,
)
from tokenwise.entrypoints.openai.structured_outputs import ToolMode
from tokenwise.entrypoints.openai.tool_calls import ToolCallReader

# (parser, reply, expected reasoning, expected content)
CASES = [
    # R1 with the opening tag in the prompt: the reply starts inside the reasoning.
    (
        "deepseek_r1",
        "Let me think.\nIt is 4.\n</think>\n\nThe answer is 4.",
        "Let me think.\nIt is 4.",
        "The answer is 4.",
    ),
    # R1 writing the opening tag itself (older templates): the tag is skipped.
    ("deepseek_r1", "<think>\nstep 1</think>done", "step 1", "done"),
    ("deepseek_r1", "  \n<think>x</think>y", "x", "y"),
    # Never closed (cut off by max_tokens): all reasoning.
    ("deepseek_r1", "still thinking about <b>it", "still thinking about <b>it", None),
    # Only the first block counts; a later tag is content.
    ("deepseek_r1", "a</think>b </think> c <think>", "a", "b </think> c <think>"),
    ("deepseek_r1", "</think>only content", None, "only content"),
    ("deepseek_r1", "<think></think>", None, None),
    # A `<` that is not the opening tag starts the reasoning.
    ("deepseek_r1", "<thinking>x</think>y", "<thinking>x", "y"),
    ("qwen3", "<think>\nHmm.\n</think>\n\nHello!", "Hmm.", "Hello!"),
    # No opening tag: all content, closing tags included (enable_thinking: false).
    ("qwen3", "Hello! a < b and </think> stays", None, "Hello! a < b and </think> stays"),
    ("qwen3", "Before <think>inside</think> after", "inside", "Before after"),
    ("qwen3", "<think>cut off <thi", "cut off <thi", None),
    ("qwen3", "text then <thi", None, "text then <thi"),
    ("qwen3", "<think>a</think>b<think>c</think>", "a", "b<think>c</think>"),
    ("qwen3", "", None, None),
]


def whole(name: str, text: str) -> tuple[str | None, str | None]:
    return split_reasoning(REASONING_PARSERS[name](), text)


def streamed(name: str, pieces: list[str]) -> tuple[str, str]:
    parser = REASONING_PARSERS[name]()
    reasoning = content = ""
    for piece in pieces:
        delta = parser.feed(piece)
        reasoning, content = reasoning + delta.reasoning, content + delta.content
    delta = parser.finish()
    return reasoning + delta.reasoning, content + delta.content


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES)
def test_whole_reply_is_split(name: str, text: str, reasoning, content) -> None:
    assert whole(name, text) == (reasoning, content)


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES)
def test_every_stream_split_gives_the_same_parts(name: str, text: str, reasoning, content) -> None:
    expected = (reasoning or "", content or "")
    splits = [
        [text[:i], text[i:j], text[j:]]
        for i in range(len(text) + 1)
        for j in range(i, len(text) + 1)
    ]
    splits.append(list(text))  # one character per delta
    rng = random.Random(0)
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, 4)))
        splits.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    for pieces in splits:
        assert streamed(name, pieces) == expected, pieces


def test_held_back_text_waits_only_for_what_a_tag_could_complete() -> None:
    parser = DeepSeekR1ReasoningParser()
    assert parser.feed("The sum </th").reasoning == "The sum"  # "</th" and its space held
    delta = parser.feed("ree is 3</think>It is 3")
    assert (delta.reasoning, delta.content) == (" </three is 3", "It is 3")
    qwen = Qwen3ReasoningParser()
    assert qwen.feed("Hi <th").content == "Hi "  # "<th" may open the reasoning
    assert qwen.feed("e").content == "<the"
    assert qwen.feed("<think> x").reasoning == "x"


def test_unknown_parser_name_lists_the_valid_ones() -> None:
    check_reasoning_parser(None)
    check_reasoning_parser("qwen3")
    with pytest.raises(ValueError, match=r"'r1'.*\['deepseek_r1', 'openai_gptoss', 'qwen3'\]"):
        check_reasoning_parser("r1")
    assert all(issubclass(cls, ReasoningParser) for cls in REASONING_PARSERS.values())


CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
# The reasoning mentions a call in the model's own syntax: only the content's call is made.
THINKING_ABOUT_A_CALL = f"I could write {CALL} here.</think>Checking.{CALL}"


def test_tool_calls_are_read_from_the_content_after_the_reasoning() -> None:
    reader = ToolCallReader(ToolMode("auto"), DeepSeekR1ReasoningParser())
    message, finish = reader.message(THINKING_ABOUT_A_CALL, "stop")
    assert message.reasoning_content == f"I could write {CALL} here."
    assert message.content == "Checking."
    assert [c.function.name for c in message.tool_calls] == ["get_weather"]
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Paris"}
    assert finish == "tool_calls"


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_streamed_reasoning_and_tool_calls(size: int) -> None:
    reader = ToolCallReader(ToolMode("auto"), DeepSeekR1ReasoningParser())
    text = THINKING_ABOUT_A_CALL
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    reasoning = content = ""
    calls, finishes = [], []
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        delta, finish = reader.delta(piece, "stop" if last else None)
        finishes.append(finish)
        if delta is None:
            continue
        reasoning += delta.reasoning_content or ""
        content += delta.content or ""
        calls += [c.function.name for c in delta.tool_calls or [] if c.function.name]
    assert reasoning == f"I could write {CALL} here."
    assert content == "Checking."
    assert calls == ["get_weather"]
    assert finishes[-1] == "tool_calls" and set(finishes[:-1]) <= {None}


def test_include_reasoning_false_drops_the_reasoning_but_still_splits() -> None:
    reader = ToolCallReader(ToolMode("none"), Qwen3ReasoningParser(), include_reasoning=False)
    message, _ = reader.message("<think>secret</think>answer", "stop")
    assert (message.reasoning_content, message.content) == (None, "answer")
    streaming = ToolCallReader(ToolMode("none"), Qwen3ReasoningParser(), include_reasoning=False)
    first, _ = streaming.delta("<think>sec", None)
    second, _ = streaming.delta("ret</think>answer", "stop")
    assert first is None
    assert (second.reasoning_content, second.content) == (None, "answer")


def test_without_a_parser_think_tags_are_content() -> None:
    message, _ = ToolCallReader(ToolMode("none")).message("<think>a</think>b", "stop")
    assert (message.reasoning_content, message.content) == (None, "<think>a</think>b")
