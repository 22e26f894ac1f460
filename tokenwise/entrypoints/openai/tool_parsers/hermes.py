"""`hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes 2 Pro and later,
Qwen2.5, Qwen3).

Each call is one JSON object between the two tags, anywhere in the reply; the text around
the calls is content. A call is reported when its block closes. A block whose body is not a
JSON object with a string `name` is not a call: it goes back into the content as the model
wrote it, and so does a block never closed.
"""

from __future__ import annotations

import json

from tokenwise.entrypoints.openai.tool_parsers.base import (
    Content,
    Event,
    ToolParser,
    call_events,
    call_from_object,
    partial_tag_len,
)

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def __init__(self, tools=None) -> None:
        super().__init__(tools)
        self._in_call = False

    def _step(self, out: list[Event], final: bool) -> bool:
        if not self._in_call:
            start = self._buffer.find(OPEN_TAG)
            if start < 0:
                keep = 0 if final else partial_tag_len(self._buffer, OPEN_TAG)
                cut = len(self._buffer) - keep
                if cut:
                    out.append(Content(self._buffer[:cut]))
                self._buffer = self._buffer[cut:]
                return False
            if start:
                out.append(Content(self._buffer[:start]))
            self._buffer = self._buffer[start + len(OPEN_TAG) :]
            self._in_call = True
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
