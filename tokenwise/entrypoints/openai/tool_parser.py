"""Tool calls in the Hermes / Qwen format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

Models tuned on this format (Hermes 2 Pro and later, Qwen2.5, Qwen3) write each call as one JSON
object between the two tags, anywhere in their reply; the text around the calls is ordinary
content. `tool_choice="auto"` generates freely and reads the calls back out with this parser.

One incremental parser serves both shapes of response: a stream feeds it each new piece of
text and sends what it returns at once; a collected response feeds the whole text. Content is
released as soon as it cannot be the start of an opening tag, so a stream holds back at most
the few characters of a partial `<tool_call` at its end. A block whose body is not a JSON
object with a string `name` is not a call: it goes back into the content verbatim, as the
model wrote it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # JSON text


@dataclass
class ParseResult:
    content: str = ""
    calls: list[ParsedToolCall] = field(default_factory=list)


def parse_call(body: str) -> ParsedToolCall | None:
    """The call in one block's body, or None if the body is not a well-formed call."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return ParsedToolCall(obj["name"], arguments)


def _partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class HermesToolParser:
    """Feed text as it arrives; each `feed` returns the content and the calls now complete."""

    def __init__(self) -> None:
        self._buffer = ""
        self._in_call = False

    def feed(self, text: str) -> ParseResult:
        out = ParseResult()
        self._buffer += text
        while True:
            if not self._in_call:
                start = self._buffer.find(OPEN_TAG)
                if start < 0:
                    keep = _partial_tag_len(self._buffer, OPEN_TAG)
                    cut = len(self._buffer) - keep
                    out.content += self._buffer[:cut]
                    self._buffer = self._buffer[cut:]
                    return out
                out.content += self._buffer[:start]
                self._buffer = self._buffer[start + len(OPEN_TAG) :]
                self._in_call = True
            end = self._buffer.find(CLOSE_TAG)
            if end < 0:
                return out
            body = self._buffer[:end]
            self._buffer = self._buffer[end + len(CLOSE_TAG) :]
            self._in_call = False
            call = parse_call(body.strip())
            if call is None:
                out.content += OPEN_TAG + body + CLOSE_TAG
            else:
                out.calls.append(call)

    def finish(self) -> str:
        """The text still held back (an unclosed block or a partial tag), as content."""
        rest = (OPEN_TAG if self._in_call else "") + self._buffer
        self._buffer, self._in_call = "", False
        return rest


def parse_tool_calls(text: str) -> ParseResult:
    """All calls in a complete reply, and the content around them (whitespace-trimmed)."""
    parser = HermesToolParser()
    result = parser.feed(text)
    result.content = (result.content + parser.finish()).strip()
    return result
