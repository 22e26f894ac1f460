"""`mistral`: Mistral's `[TOOL_CALLS]` format, in both of its generations.

- Older models (tokenizer v3, Mistral-7B-Instruct-v0.3, Mixtral): `[TOOL_CALLS]` then one JSON
  array of `{"name": ..., "arguments": {...}}` objects. The calls are reported when the array
  closes; an array that is not a list of calls is content, as written.
- Newer models (tokenizer v11+, Mistral Small 3.1+, Devstral, Magistral): each call is
  `[TOOL_CALLS]name[ARGS]{...}`, repeated for parallel calls. The name is reported at `[ARGS]`
  and the arguments stream as they arrive, up to the next `[TOOL_CALLS]` or the end of the
  reply (surrounding whitespace trimmed). A `[CALL_ID]id` after the name (v13) is skipped, and
  a name followed directly by `{` (no `[ARGS]`) is read the same way.

Text before the first `[TOOL_CALLS]` is content. `[TOOL_CALLS]` and `[ARGS]` are special
tokens, so this parser asks for them to be kept in the decoded text (`needs_special_tokens`).
"""

from __future__ import annotations

import json

from tokenwise.entrypoints.openai.tool_parsers.base import (
    BracketScanner,
    CallStart,
    Content,
    Event,
    ToolParser,
    call_events,
    call_from_object,
    find_first,
    partial_tag_len,
)

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
_SCANNER = BracketScanner('"')


class MistralToolParser(ToolParser):
    name = "mistral"
    needs_special_tokens = True

    def __init__(self, tools=None) -> None:
        super().__init__(tools)
        # "content" (before a [TOOL_CALLS]), "after_tag", "name", "args"
        self._mode = "content"

    def _step(self, out: list[Event], final: bool) -> bool:
        mode = self._mode
        if mode == "content":
            start = self._buffer.find(TOOL_CALLS)
            if start < 0:
                keep = 0 if final else partial_tag_len(self._buffer, TOOL_CALLS)
                self._emit_content(out, len(self._buffer) - keep)
                return False
            self._emit_content(out, start)
            self._buffer = self._buffer[len(TOOL_CALLS) :]
            self._mode = "after_tag"
            return True
        if mode == "after_tag":
            head = self._buffer.lstrip()
            if not head:
                if final:
                    self._buffer = ""
                return False
            if head.startswith("["):
                return self._array(out, head, final)
            self._buffer, self._mode = head, "name"
            return True
        if mode == "name":
            found = find_first(self._buffer, (ARGS, "{"))
            if found is None:
                if final:  # a name without arguments: content, as written
                    out.append(Content(TOOL_CALLS + self._buffer))
                    self._buffer, self._mode = "", "content"
                return False
            at, tag = found
            name = self._buffer[:at].split(CALL_ID)[0].strip()
            out.append(CallStart(name))
            self._buffer = self._buffer[at + (len(tag) if tag == ARGS else 0) :]
            self._mode = "args"
            return True
        return self._args(out, final)

    def _emit_content(self, out: list[Event], cut: int) -> None:
        if cut:
            out.append(Content(self._buffer[:cut]))
        self._buffer = self._buffer[cut:]

    def _array(self, out: list[Event], head: str, final: bool) -> bool:
        end = _SCANNER.end(head)
        if end is None and not final:
            return False
        calls = None
        if end is not None:
            try:
                items = json.loads(head[:end])
            except ValueError:
                items = None
            if isinstance(items, list):
                calls = [call_from_object(item) for item in items]
        if not calls or any(c is None for c in calls):
            out.append(Content(TOOL_CALLS + self._buffer))  # not calls: as written
            self._buffer, self._mode = "", "content"
            return False
        for call in calls:
            assert call is not None
            out.extend(call_events(*call))
        self._buffer, self._mode = head[end:], "content"
        return True

    def _args(self, out: list[Event], final: bool) -> bool:
        """Stream the arguments up to the next call (or the end of the reply)."""
        if self._stream_args(out, final, (TOOL_CALLS,)) is None:
            return False
        self._mode = "after_tag"
        return True
