"""What every tool-call parser shares: the events it reports, and the scanning it needs.

A model writes tool calls in its own family's format, inside ordinary text. A parser reads
that text incrementally and reports *events*: content, the start of a call (its name), and
pieces of the call's JSON arguments. The reader (`tool_calls`) turns events into OpenAI's
shapes: a collected response joins them, a stream sends them as `delta.tool_calls` pieces.
Because both shapes come from the same events, a stream cut anywhere gives exactly the
collected reply, provided each parser's decisions depend only on the text, never on where it
was cut: a parser decides nothing until the text seen so far settles the question, holding
back what could still turn out to be (part of) a tag.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass
class Content:
    text: str


@dataclass
class CallStart:
    """A new call; its arguments follow as `ArgsPiece`s (all of them, possibly in one)."""

    name: str


@dataclass
class ArgsPiece:
    text: str


Event = Content | CallStart | ArgsPiece


def partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def held_back(text: str, tags: tuple[str, ...]) -> int:
    """How much of `text`'s end must wait: the longest partial prefix of any of `tags`."""
    return max((partial_tag_len(text, tag) for tag in tags), default=0)


def find_first(text: str, tags: tuple[str, ...]) -> tuple[int, str] | None:
    """The earliest of `tags` in `text` (position, tag), or None."""
    best: tuple[int, str] | None = None
    for tag in tags:
        at = text.find(tag)
        if at >= 0 and (best is None or at < best[0]):
            best = (at, tag)
    return best


def json_text(value: Any) -> str:
    """Arguments as OpenAI sends them: JSON text (non-ASCII kept as is)."""
    return json.dumps(value, ensure_ascii=False)


def call_events(name: str, arguments: Any) -> list[Event]:
    """A whole call's events; `arguments` is a JSON value or JSON text already."""
    text = arguments if isinstance(arguments, str) else json_text(arguments)
    return [CallStart(name), ArgsPiece(text)]


def call_from_object(
    obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")
) -> tuple[str, Any] | None:
    """(name, arguments) of a `{"name": ..., "arguments"|"parameters": ...}` object, or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments: Any = {}
    for key in args_keys:
        if key in obj:
            arguments = obj[key]
            break
    return obj["name"], arguments


class BracketScanner:
    """Finds where a bracketed value (a JSON object or array, a Python list) that starts at the
    beginning of the text ends, skipping brackets inside strings. `quotes`: the characters
    that open a string (JSON: `"`; Python: both quotes)."""

    def __init__(self, quotes: str = '"') -> None:
        self.quotes = quotes

    def end(self, text: str) -> int | None:
        """Index just past the closing bracket of the value opening `text`, or None."""
        depth, quote, escaped = 0, "", False
        for i, ch in enumerate(text):
            if quote:
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == quote:
                    quote = ""
            elif ch in self.quotes:
                quote = ch
            elif ch in "[{(":
                depth += 1
            elif ch in "]})":
                depth -= 1
                if depth == 0:
                    return i + 1
        return None


class ToolParser:
    """One reply's parser: `feed` each new piece of text, then `finish` once it has ended.

    `tools` are the request's tools (as dicts: `{"type": "function", "function": {...}}`);
    a format whose arguments are not JSON (qwen3_coder) converts values by their schemas."""

    name: ClassVar[str]
    # The format's markers are special tokens that decoding would otherwise drop.
    needs_special_tokens: ClassVar[bool] = False

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = tools or []
        self._buffer = ""

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        out: list[Event] = []
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> list[Event]:
        """Events for what was held back, now that no tag can complete any more."""
        out: list[Event] = []
        while self._step(out, final=True):
            pass
        return out

    def _content_until(self, tag: str, out: list[Event], final: bool) -> bool:
        """Pass the buffer on as content up to `tag` (holding back what may be its start,
        unless `final`); True, with the buffer just past `tag`, when `tag` is there."""
        start = self._buffer.find(tag)
        if start >= 0:
            cut = start
        else:
            cut = len(self._buffer) - (0 if final else partial_tag_len(self._buffer, tag))
        if cut:
            out.append(Content(self._buffer[:cut]))
        self._buffer = self._buffer[cut + (len(tag) if start >= 0 else 0) :]
        return start >= 0

    def _step(self, out: list[Event], final: bool) -> bool:
        """Consume what the buffer decides, appending events; True while another step may
        consume more. With `final`, the text is complete and everything must be decided."""
        raise NotImplementedError

    _args_started = False

    def _stream_args(self, out: list[Event], final: bool, ends: tuple[str, ...]) -> str | None:
        """Stream a call's arguments up to the first of `ends` (consumed and returned; None
        while none has come). Whitespace at either end of the arguments is dropped, so
        trailing whitespace waits until text follows it, as does a partial end tag."""
        found = find_first(self._buffer, ends)
        if found is not None:
            at, tag = found
            piece = self._buffer[:at]
            piece = (piece if self._args_started else piece.lstrip()).rstrip()
            if piece:
                out.append(ArgsPiece(piece))
            self._buffer = self._buffer[at + len(tag) :]
            self._args_started = False
            return tag
        keep = 0 if final else held_back(self._buffer, ends)
        text = self._buffer[: len(self._buffer) - keep]
        dropped = 0
        if not self._args_started:
            dropped = len(text) - len(text.lstrip())
            text = text[dropped:]
        certain = text if final else text.rstrip()
        if certain:
            out.append(ArgsPiece(certain))
            self._args_started = True
        self._buffer = "" if final else self._buffer[dropped + len(certain) :]
        return None
