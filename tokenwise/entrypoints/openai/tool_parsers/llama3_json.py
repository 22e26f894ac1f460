"""`llama3_json`: Llama 3.1 / 3.2 / 3.3 JSON tool calls.

With tools, Llama 3.x answers a call with nothing but JSON: `{"name": ..., "parameters":
{...}}` (`arguments` is accepted too), several calls separated by `;`, optionally after the
`<|python_tag|>` token (a special token, so usually already dropped from the text). The
format has no closing tag, so it is recognised by how the reply starts: a reply whose first
visible text is `<|python_tag|>` or `{` is read as calls; any other reply is content, released
as it arrives. A call written name first (`{"name": "NAME", "parameters": {`) is reported at
once and its arguments stream as they arrive, up to the brace that closes them; a call in
another key order is reported once its object closes. Text after the calls that is not
another call (or an object that is not a call) ends the calls: from there on it is content.
"""

from __future__ import annotations

import json
import re

from tokenwise.entrypoints.openai.tool_parsers.base import (
    ArgsPiece,
    BracketScanner,
    CallStart,
    Content,
    Event,
    ToolParser,
    call_events,
    call_from_object,
)

PYTHON_TAG = "<|python_tag|>"
_SCANNER = BracketScanner('"')
# A call's start in the usual key order, up to its arguments object's opening brace.
_STREAM_START = re.compile(
    r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:parameters|arguments)"\s*:\s*(?=\{)'
)


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def __init__(self, tools=None) -> None:
        super().__init__(tools)
        # "start": nothing visible yet; "calls": before the next object; "args": streaming a
        # call's arguments; "close": before the brace closing that call; "content": the rest.
        self._mode = "start"
        self._args = ""  # the streaming call's arguments sent so far

    def _step(self, out: list[Event], final: bool) -> bool:
        if self._mode == "content":
            if self._buffer:
                out.append(Content(self._buffer))
                self._buffer = ""
            return False
        if self._mode == "start":
            head = self._buffer.lstrip()
            if head.startswith(PYTHON_TAG):
                self._buffer, self._mode = head[len(PYTHON_TAG) :], "calls"
                return True
            if not final and (not head or PYTHON_TAG.startswith(head)):
                return False  # undecided: only whitespace or part of the tag so far
            self._mode = "calls" if head.startswith("{") else "content"
            return True
        if self._mode == "args":
            return self._stream(out, final)
        if self._mode == "close":
            head = self._buffer.lstrip()
            if head.startswith("}"):
                self._buffer, self._mode = head[1:], "calls"
                return True
            if head or final:  # more keys after the arguments: the rest is content
                self._buffer, self._mode = head, "content"
                return True
            return False
        # Between calls: separators are skipped; an object is a call, anything else content.
        head = self._buffer.lstrip().lstrip(";").lstrip()
        if not head:
            if final:
                self._buffer = ""
            return False
        if not head.startswith("{"):
            self._buffer, self._mode = head, "content"
            return True
        match = _STREAM_START.match(head)
        if match:
            out.append(CallStart(json.loads(match.group(1))))
            self._buffer, self._mode, self._args = head[match.end() :], "args", ""
            return True
        end = _SCANNER.end(head)
        if end is None:
            if final:  # an object cut off: content, as written
                self._buffer, self._mode = head, "content"
                return True
            return False
        try:
            call = call_from_object(json.loads(head[:end]), ("parameters", "arguments"))
        except ValueError:
            call = None
        if call is None:
            self._buffer, self._mode = head, "content"
            return True
        out.extend(call_events(*call))
        self._buffer = head[end:]
        return True

    def _stream(self, out: list[Event], final: bool) -> bool:
        """Send the arguments as they arrive; the scanner finds the brace that ends them."""
        seen = self._args + self._buffer
        end = _SCANNER.end(seen)
        stop = len(seen) if end is None else end
        piece = seen[len(self._args) : stop]
        if piece:
            out.append(ArgsPiece(piece))
        self._args, self._buffer = seen[:stop], seen[stop:]
        if end is None:
            if final:
                self._buffer, self._mode = "", "content"
            return False
        self._mode = "close"
        return True
