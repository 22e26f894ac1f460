"""A chat reply as OpenAI's assistant message: reasoning, content, `tool_calls`, and the finish
reason.

With a reasoning parser (`reasoning`, `--reasoning-parser`), the reply's reasoning part is split
off first and everything below reads only the content after it: a call the model considers in
its reasoning is not made.

How the reply's text is read depends on the request's `ToolMode` (`structured_outputs`):
plain content; content with calls in the model family's own format, read by the server's
tool-call parser (`tool_parsers`, `--tool-call-parser`); the arguments of one forced function;
or a JSON array of calls (`tool_choice="required"`). A reply that made calls and ended
normally finishes with "tool_calls", as OpenAI's do.

Streams use the same reader, one per choice, fed each delta's text. A call's first delta
carries its index, id and name, later ones the next pieces of its arguments: forced arguments
stream as they are generated, a parser's calls as the parser reads them (some formats only
once a call is complete); a "required" array is sent when the reply ends, since its calls are
only known once the array parses. A collected reply joins the very same parser events, so a
stream and a collected response never disagree.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from tokenwise.entrypoints.openai.protocol import (
    AssistantMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    new_tool_call_id,
)
from tokenwise.entrypoints.openai.reasoning import ReasoningParser, split_reasoning
from tokenwise.entrypoints.openai.structured_outputs import ToolMode
from tokenwise.entrypoints.openai.tool_parsers import DEFAULT_TOOL_PARSER, TOOL_PARSERS
from tokenwise.entrypoints.openai.tool_parsers.base import (
    ArgsPiece,
    CallStart,
    Content,
    Event,
    ToolParser,
)


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # JSON text


@dataclass
class ParseResult:
    content: str = ""
    calls: list[ParsedToolCall] = field(default_factory=list)


def join_events(events: list[Event]) -> ParseResult:
    """A whole reply's content and calls from its parser's events."""
    out = ParseResult()
    for event in events:
        if isinstance(event, Content):
            out.content += event.text
        elif isinstance(event, CallStart):
            out.calls.append(ParsedToolCall(event.name, ""))
        elif out.calls:  # ArgsPiece
            out.calls[-1].arguments += event.text
    return out


def parse_tool_calls(
    text: str, parser: str = DEFAULT_TOOL_PARSER, tools: list[dict] | None = None
) -> ParseResult:
    """All calls in a complete reply, and the content around them (whitespace-trimmed)."""
    reader = TOOL_PARSERS[parser](tools)
    result = join_events(reader.feed(text) + reader.finish())
    result.content = result.content.strip()
    return result


def parse_call_array(text: str) -> list[ParsedToolCall] | None:
    """The calls of a `tool_choice="required"` reply (None if it is not a complete array)."""
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list):
        return None
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        args = json.dumps(item.get("arguments", {}), ensure_ascii=False)
        calls.append(ParsedToolCall(item["name"], args))
    return calls


def _finish(reason: str | None, made_calls: bool) -> str | None:
    return "tool_calls" if made_calls and reason == "stop" else reason


class ToolCallReader:
    """Reads one choice's reply: `message` for a collected response, `delta` for a stream.

    `reasoning` (a fresh parser per choice) splits off the reasoning part; with
    `include_reasoning=False` (vLLM's request field) it is split off and dropped. `parser`
    (a fresh one per choice, given the request's tools) reads "auto" replies: Hermes blocks
    by default."""

    def __init__(
        self,
        mode: ToolMode,
        reasoning: ReasoningParser | None = None,
        include_reasoning: bool = True,
        parser: ToolParser | None = None,
    ) -> None:
        self.mode = mode
        self._reasoning = reasoning
        self._include_reasoning = include_reasoning
        self._parser = parser if parser is not None else TOOL_PARSERS[DEFAULT_TOOL_PARSER]()
        self._num_calls = 0
        self._named_call_id: str | None = None
        self._buffer = ""

    def message(self, text: str, finish_reason: str | None) -> tuple[AssistantMessage, str | None]:
        reasoning: str | None = None
        if self._reasoning is not None:
            reasoning, after = split_reasoning(self._reasoning, text)
            text = after or ""
        content: str | None = text
        calls: list[ParsedToolCall] = []
        if self.mode.kind == "auto":
            # Without calls the content is as the parser passed it on, untrimmed: the text
            # itself, unless the format wraps even plain answers (harmony's messages).
            parsed = join_events(self._parser.feed(text) + self._parser.finish())
            calls = parsed.calls
            content = (parsed.content.strip() or None) if calls else parsed.content
        elif self.mode.kind == "named":
            assert self.mode.name is not None
            content, calls = None, [ParsedToolCall(self.mode.name, text)]
        elif self.mode.kind == "required":
            array = parse_call_array(text)
            if array:
                content, calls = None, array
        tool_calls = [
            ToolCall(function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls
        ]
        if self._reasoning is not None and not content:
            content = None  # the reply was all reasoning (and calls)
        message = AssistantMessage(
            content=content,
            reasoning_content=reasoning if self._include_reasoning else None,
            tool_calls=tool_calls or None,
        )
        return message, _finish(finish_reason, bool(calls))

    def delta(self, text: str, finish_reason: str | None) -> tuple[DeltaMessage | None, str | None]:
        """The delta to send for this piece of text (None: nothing to send yet)."""
        last = finish_reason is not None
        reasoning = ""
        if self._reasoning is not None:
            split = self._reasoning.feed(text)
            if last:
                rest = self._reasoning.finish()
                split.reasoning += rest.reasoning
                split.content += rest.content
            reasoning, text = split.reasoning, split.content
        if not self._include_reasoning:
            reasoning = ""
        content, pieces = self._read_delta(text, last)
        reason = _finish(finish_reason, self._num_calls > 0)
        if not content and not pieces and not reasoning:
            return (DeltaMessage() if reason is not None else None), reason
        delta = DeltaMessage(
            reasoning_content=reasoning or None, content=content or None, tool_calls=pieces or None
        )
        return delta, reason

    def _read_delta(self, text: str, last: bool) -> tuple[str, list[DeltaToolCall]]:
        kind = self.mode.kind
        if kind == "none":
            return text, []
        if kind == "named":
            return "", self._named_delta(text)
        if kind == "required":
            self._buffer += text
            if not last:
                return "", []
            calls = parse_call_array(self._buffer)
            if not calls:
                return self._buffer, []
            return "", self._whole_calls(calls)
        events = self._parser.feed(text) + (self._parser.finish() if last else [])
        return self._event_deltas(events)

    def _event_deltas(self, events: list[Event]) -> tuple[str, list[DeltaToolCall]]:
        """Content and call pieces for one delta; a call's argument pieces in the same delta
        are joined, so each call appears at most once per delta."""
        content, pieces = "", []
        for event in events:
            if isinstance(event, Content):
                content += event.text
            elif isinstance(event, CallStart):
                function = DeltaFunctionCall(name=event.name, arguments="")
                pieces.append(
                    DeltaToolCall(
                        index=self._num_calls, id=new_tool_call_id(), type="function",
                        function=function,
                    )
                )  # fmt: skip
                self._num_calls += 1
            elif isinstance(event, ArgsPiece) and self._num_calls:
                index = self._num_calls - 1
                if pieces and pieces[-1].index == index:
                    last = pieces[-1].function
                    last.arguments = (last.arguments or "") + event.text
                else:
                    piece = DeltaFunctionCall(arguments=event.text)
                    pieces.append(DeltaToolCall(index=index, function=piece))
        return content, pieces

    def _named_delta(self, text: str) -> list[DeltaToolCall]:
        if not text:
            return []
        if self._named_call_id is None:
            self._named_call_id = new_tool_call_id()
            self._num_calls = 1
            first = DeltaFunctionCall(name=self.mode.name, arguments=text)
            return [DeltaToolCall(index=0, id=self._named_call_id, type="function", function=first)]
        return [DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=text))]

    def _whole_calls(self, calls: list[ParsedToolCall]) -> list[DeltaToolCall]:
        out = []
        for call in calls:
            out.append(
                DeltaToolCall(
                    index=self._num_calls,
                    id=new_tool_call_id(),
                    type="function",
                    function=DeltaFunctionCall(name=call.name, arguments=call.arguments),
                )
            )
            self._num_calls += 1
        return out
