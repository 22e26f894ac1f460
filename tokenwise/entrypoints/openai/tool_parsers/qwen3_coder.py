"""`qwen3_coder`: Qwen3-Coder's XML calls.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Values are written raw (no JSON quoting), so they are converted by the type the tool's JSON
schema gives the parameter: integers and numbers to numbers, booleans, null, objects and
arrays parsed; strings, parameters the schema does not type, and values that do not convert
stay strings. One newline right after `<parameter=P>` and one right before `</parameter>`
are the template's layout, not the value, and are dropped.

The name is reported at `<function=NAME>`, and the arguments stream one parameter at a time as
each closes (`{"city": "Paris"`, then `, "days": 3`, then `}` at `</function>`). A block that
does not open with `<function=` is not a call: it stays content, as written; so does a block
cut off before its function is named. Text outside the blocks is content.
"""

from __future__ import annotations

import json
from typing import Any

from tokenwise.entrypoints.openai.tool_parsers.base import (
    ArgsPiece,
    CallStart,
    Content,
    Event,
    ToolParser,
    find_first,
    held_back,
    json_text,
    partial_tag_len,
)

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
FUNCTION = "<function="
FUNCTION_END = "</function>"
PARAMETER = "<parameter="
PARAMETER_END = "</parameter>"


def _param_types(tools: list[dict[str, Any]], name: str) -> dict[str, Any]:
    for tool in tools:
        function = tool.get("function") or {}
        if function.get("name") == name:
            return (function.get("parameters") or {}).get("properties") or {}
    return {}


def convert_value(raw: str, schema: Any) -> Any:
    """A raw parameter value as the JSON value its schema's type asks for."""
    types = schema.get("type") if isinstance(schema, dict) else None
    types = [types] if isinstance(types, str) else list(types or [])
    text = raw.strip()
    for kind in types:
        if kind == "string":
            return raw
        if kind == "null" and text == "null":
            return None
        if kind == "boolean" and text.lower() in ("true", "false"):
            return text.lower() == "true"
        if kind in ("integer", "number", "object", "array"):
            try:
                value = json.loads(text)
            except ValueError:
                continue
            ok = {
                "integer": isinstance(value, int) and not isinstance(value, bool),
                "number": isinstance(value, (int, float)) and not isinstance(value, bool),
                "object": isinstance(value, dict),
                "array": isinstance(value, list),
            }[kind]
            if ok:
                return value
    return raw


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"

    def __init__(self, tools=None) -> None:
        super().__init__(tools)
        # "content", "open" (after <tool_call>), "function" (between parameters), "param",
        # "close" (after </function>)
        self._mode = "content"
        self._types: dict[str, Any] = {}
        self._num_params = 0
        self._param_name = ""

    def _step(self, out: list[Event], final: bool) -> bool:
        return getattr(self, "_" + self._mode)(out, final)

    def _take(self, out: list[Event], cut: int, as_content: bool = True) -> None:
        if cut and as_content:
            out.append(Content(self._buffer[:cut]))
        self._buffer = self._buffer[cut:]

    def _content(self, out: list[Event], final: bool) -> bool:
        start = self._buffer.find(OPEN_TAG)
        if start < 0:
            keep = 0 if final else partial_tag_len(self._buffer, OPEN_TAG)
            self._take(out, len(self._buffer) - keep)
            return False
        self._take(out, start)
        self._mode = "open"
        return True

    def _open(self, out: list[Event], final: bool) -> bool:
        """After `<tool_call>`: a call only if `<function=NAME>` comes next."""
        head = self._buffer[len(OPEN_TAG) :].lstrip()
        if head.startswith(FUNCTION):
            end = head.find(">")
            if end >= 0:
                name = head[len(FUNCTION) : end].strip()
                out.append(CallStart(name))
                self._types = _param_types(self.tools, name)
                self._num_params = 0
                self._buffer, self._mode = head[end + 1 :], "function"
                return True
        elif (head and not FUNCTION.startswith(head)) or final:
            self._take(out, len(OPEN_TAG))  # not a call: the tag is content
            self._mode = "content"
            return True
        if final:  # cut off inside the function's name
            self._take(out, len(self._buffer))
            self._mode = "content"
        return False

    def _function(self, out: list[Event], final: bool) -> bool:
        """Between parameters: the next `<parameter=P>` or `</function>`; other text is
        layout and dropped."""
        found = find_first(self._buffer, (PARAMETER, FUNCTION_END))
        if found is None:
            if final:
                self._end_call(out)
                self._buffer, self._mode = "", "content"
            else:
                keep = held_back(self._buffer, (PARAMETER, FUNCTION_END))
                self._buffer = self._buffer[len(self._buffer) - keep :]
            return False
        at, tag = found
        if tag == FUNCTION_END:
            self._end_call(out)
            self._buffer, self._mode = self._buffer[at + len(tag) :], "close"
            return True
        end = self._buffer.find(">", at)
        if end < 0:
            if final:
                self._end_call(out)
                self._buffer, self._mode = "", "content"
            return False
        self._param_name = self._buffer[at + len(PARAMETER) : end].strip()
        self._buffer, self._mode = self._buffer[end + 1 :], "param"
        return True

    def _param(self, out: list[Event], final: bool) -> bool:
        end = self._buffer.find(PARAMETER_END)
        if end < 0 and not final:
            return False
        raw = self._buffer if end < 0 else self._buffer[:end]
        raw = raw.removeprefix("\n").removesuffix("\n")
        value = convert_value(raw, self._types.get(self._param_name))
        sep = "{" if self._num_params == 0 else ", "
        out.append(ArgsPiece(f"{sep}{json_text(self._param_name)}: {json_text(value)}"))
        self._num_params += 1
        self._buffer = "" if end < 0 else self._buffer[end + len(PARAMETER_END) :]
        self._mode = "function"
        return True

    def _close(self, out: list[Event], final: bool) -> bool:
        """After `</function>`: up to `</tool_call>` (whitespace between is dropped)."""
        head = self._buffer.lstrip()
        if head.startswith(CLOSE_TAG):
            self._buffer, self._mode = head[len(CLOSE_TAG) :], "content"
            return True
        if head.startswith(FUNCTION):  # another function in the same block
            self._buffer, self._mode = OPEN_TAG + head, "open"
            return True
        if final or (head and not CLOSE_TAG.startswith(head) and not FUNCTION.startswith(head)):
            self._buffer, self._mode = head, "content"
            return bool(head) or not final
        return False

    def _end_call(self, out: list[Event]) -> None:
        out.append(ArgsPiece("}" if self._num_params else "{}"))
