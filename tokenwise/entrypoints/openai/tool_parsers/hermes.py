"""`hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes 2 Pro and later,
Qwen2.5, Qwen3).

Each call is one JSON object between the two tags, anywhere in the reply; the text around
the calls is content. A block that opens the way these models write it, `{"name": "NAME",
"arguments": {` (or `"parameters"`), is a call from there on: its name is reported at once and
its arguments stream as the model writes them, up to the object's closing brace before
`</tool_call>` (a reply cut off inside them keeps what was written). Any other block is read
when it closes: a JSON object with a string `name` is a call; anything else goes back into
the content as the model wrote it, and so does such a block never closed.
"""

from __future__ import annotations

import json
import re

from tokenwise.entrypoints.openai.tool_parsers.base import (
    ArgsPiece,
    CallStart,
    Content,
    Event,
    ToolParser,
    call_events,
    call_from_object,
    partial_tag_len,
)

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
# The start of a block in the usual key order, up to the arguments object's opening brace.
_STREAM_START = re.compile(
    r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)'
)


class HermesToolParser(ToolParser):
    name = "hermes"

    def __init__(self, tools=None) -> None:
        super().__init__(tools)
        self._in_call = False
        self._streaming = False  # inside a call's arguments, streaming them

    def _step(self, out: list[Event], final: bool) -> bool:
        if not self._in_call:
            if not self._content_until(OPEN_TAG, out, final):
                return False
            self._in_call = True
        if self._streaming:
            return self._arguments(out, final)
        match = _STREAM_START.match(self._buffer)
        if match:
            out.append(CallStart(json.loads(match.group(1))))
            self._buffer, self._streaming = self._buffer[match.end() :], True
            return True
        end = self._buffer.find(CLOSE_TAG)
        if end < 0:
            if final:  # never closed: as written
                out.append(Content(OPEN_TAG + self._buffer))
                self._buffer, self._in_call = "", False
            return False
        body = self._buffer[:end]
        self._buffer = self._buffer[end + len(CLOSE_TAG) :]
        self._in_call = False
        try:
            call = call_from_object(json.loads(body))
        except ValueError:
            call = None
        if call is None:
            out.append(Content(OPEN_TAG + body + CLOSE_TAG))
        else:
            out.extend(call_events(*call))
        return True

    def _arguments(self, out: list[Event], final: bool) -> bool:
        """Stream the arguments object. The last `}` before `</tool_call>` closes the call's
        object, not the arguments, so a trailing `}` (and whitespace) waits for what follows."""
        end = self._buffer.find(CLOSE_TAG)
        if end >= 0 or final:
            piece = self._buffer[: end if end >= 0 else len(self._buffer)].rstrip()
            if end >= 0 and piece.endswith("}"):
                piece = piece[:-1].rstrip()
            if piece:
                out.append(ArgsPiece(piece))
            self._buffer = self._buffer[end + len(CLOSE_TAG) :] if end >= 0 else ""
            self._in_call = self._streaming = False
            return end >= 0
        text = self._buffer[: len(self._buffer) - partial_tag_len(self._buffer, CLOSE_TAG)]
        certain = text.rstrip()
        if certain.endswith("}"):
            certain = certain[:-1].rstrip()
        if certain:
            out.append(ArgsPiece(certain))
            self._buffer = self._buffer[len(certain) :]
        return False
