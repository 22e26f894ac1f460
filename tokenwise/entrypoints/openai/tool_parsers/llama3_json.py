"""`llama3_json`: Llama 3.1 / 3.2 / 3.3 JSON tool calls.

With tools, Llama 3.x answers a call with nothing but JSON: `{"name": ..., "parameters":
{...}}` (`arguments` is accepted too), several calls separated by `;`, optionally after the
`<|python_tag|>` token (a special token, so usually already dropped from the text). The
format has no closing tag, so it is recognised by how the reply starts: a reply whose first
visible text is `<|python_tag|>` or `{` is read as calls; any other reply is content, released
as it arrives. Each call is reported once its object closes. Text after the calls that is not
another call (or an object that is not a call) ends the calls: from there on it is content.
"""

from __future__ import annotations

import json

from tokenwise.entrypoints.openai.tool_parsers.base import (
    BracketScanner,
    Content,
    Event,
    ToolParser,
    call_events,
    call_from_object,
)

PYTHON_TAG = "<|python_tag|>"
_SCANNER = BracketScanner('"')


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def __init__(self, tools=None) -> None:
        super().__init__(tools)
        # "start": nothing visible yet; "calls": before the next object; "content": the rest.
        self._mode = "start"

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
        # Between calls: separators are skipped; an object is a call, anything else content.
        head = self._buffer.lstrip().lstrip(";").lstrip()
        if not head:
            if final:
                self._buffer = ""
            return False
        if not head.startswith("{"):
            self._buffer, self._mode = head, "content"
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
