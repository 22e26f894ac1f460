"""`pythonic`: calls written as a Python list of function calls (Llama 3.2 / 4 with the
pythonic templates, ToolACE and other models tuned on it):

    [get_weather(city="Paris", days=3), get_time()]

The list is parsed with `ast` and each argument read with `ast.literal_eval`: nothing the
model writes is ever evaluated. Arguments must be keywords with literal values (strings,
numbers, True/False/None, lists, dicts, tuples), converted to JSON. Llama 4 may wrap the list
in `<|python_start|>` ... `<|python_end|>`; those are skipped.

The format has no tag, so it is recognised by how the reply starts: a reply whose first
visible text is `[` is read as calls once its list closes; if the list does not parse as
calls, it is content as written. Any other reply is content, released as it arrives; so is
text after the list.
"""

from __future__ import annotations

import ast
from typing import Any

from tokenwise.entrypoints.openai.tool_parsers.base import (
    BracketScanner,
    Content,
    Event,
    ToolParser,
    call_events,
)

PYTHON_START = "<|python_start|>"
PYTHON_END = "<|python_end|>"
_SCANNER = BracketScanner("\"'")


def parse_call_list(text: str) -> list[tuple[str, Any]] | None:
    """The (name, arguments) of each call in a `[f(a=1), g()]` list, or None."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or node.args:
            return None
        name = _dotted_name(node.func)
        if name is None:
            return None
        arguments: dict[str, Any] = {}
        for keyword in node.keywords:
            if keyword.arg is None:  # **kwargs
                return None
            try:
                arguments[keyword.arg] = _jsonable(ast.literal_eval(keyword.value))
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                return None
        calls.append((name, arguments))
    return calls


def _dotted_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted_name(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _jsonable(value: Any) -> Any:
    """A literal as a JSON value (tuples and sets become lists); others are refused."""
    if isinstance(value, (tuple, list, set, frozenset)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError("non-string key")
        return {k: _jsonable(v) for k, v in value.items()}
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise TypeError(f"not JSON: {type(value).__name__}")


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def __init__(self, tools=None) -> None:
        super().__init__(tools)
        self._mode = "start"  # then "list" (reading the call list), "after" or "content"

    def _step(self, out: list[Event], final: bool) -> bool:
        if self._mode == "content":
            if self._buffer:
                out.append(Content(self._buffer))
                self._buffer = ""
            return False
        head = self._buffer.lstrip()
        if self._mode == "start":
            if head.startswith(PYTHON_START):
                self._buffer, self._mode = head[len(PYTHON_START) :], "list"
                return True
            if not final and (not head or PYTHON_START.startswith(head)):
                return False
            self._mode = "list" if head.startswith("[") else "content"
            return True
        if self._mode == "after":  # after the list: skip `<|python_end|>`, the rest is content
            if head.startswith(PYTHON_END):
                head = head[len(PYTHON_END) :]
            elif not final and PYTHON_END.startswith(head):
                return False
            self._buffer, self._mode = head, "content"
            return True
        if not head and not final:
            return False
        end = _SCANNER.end(head) if head.startswith("[") else None
        if end is None:
            if final or not head.startswith("["):
                self._mode = "content"
                return True
            return False
        calls = parse_call_list(head[:end])
        if calls is None:
            self._mode = "content"
            return True
        for name, arguments in calls:
            out.extend(call_events(name, arguments))
        self._buffer, self._mode = head[end:], "after"
        return True
