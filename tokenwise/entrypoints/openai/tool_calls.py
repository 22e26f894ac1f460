"""A chat reply as OpenAI's assistant message: reasoning, content, `tool_calls`, and the finish
reason.

With a reasoning parser (`reasoning`, `--reasoning-parser`), the reply's reasoning part is split
off first and everything below reads only the content after it: a call the model considers in
its reasoning is not made.

How the reply's text is read depends on the request's `ToolMode` (`structured_outputs`):
plain content; content with Hermes `<tool_call>` blocks (`tool_parser`); the arguments of one
forced function; or a JSON array of calls (`tool_choice="required"`). A reply that made calls
and ended normally finishes with "tool_calls", as OpenAI's do.

Streams use the same reader, one per choice, fed each delta's text. Forced arguments stream as
they are generated (the first delta carries the call's id and name, later ones the next piece
of the arguments); Hermes calls are sent whole when their block closes; a "required" array is
sent when the reply ends, since its calls are only known once the array parses.
"""

from __future__ import annotations

import json

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
from tokenwise.entrypoints.openai.tool_parser import (
    HermesToolParser,
    ParsedToolCall,
    parse_tool_calls,
)


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
    `include_reasoning=False` (vLLM's request field) it is split off and dropped."""

    def __init__(
        self,
        mode: ToolMode,
        reasoning: ReasoningParser | None = None,
        include_reasoning: bool = True,
    ) -> None:
        self.mode = mode
        self._reasoning = reasoning
        self._include_reasoning = include_reasoning
        self._parser = HermesToolParser()
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
            parsed = parse_tool_calls(text)
            content, calls = (parsed.content or None, parsed.calls) if parsed.calls else (text, [])
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
        parsed = self._parser.feed(text)
        content = parsed.content + (self._parser.finish() if last else "")
        return content, self._whole_calls(parsed.calls)

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
