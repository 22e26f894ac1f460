"""`openai`: gpt-oss's harmony tool calls (vLLM's `--tool-call-parser openai`).

A call is a message addressed to one of the request's functions, its body the JSON arguments:

    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>
    {"city":"Paris"}<|call|>          (one line)

Its name is reported as soon as the header is complete and its arguments stream as the model
writes them (`<|call|>` is a stop token, so the reply usually ends inside them; a call without
arguments has `{}`). `final` messages and commentary preambles are content; the `analysis`
channel is reasoning, which only the reasoning parser `openai_gptoss` returns (run alone, this
parser leaves it out, as vLLM's does). A message to any other recipient (a built-in tool such as
`browser.search`, which this server does not run) goes back into the content as written, and
so does text outside any message. The format's tokens are special: replies read by this parser
are decoded with them kept.
"""

from __future__ import annotations

from tokenwise.entrypoints.openai.tool_parsers.base import (
    ArgsPiece,
    CallStart,
    Content,
    Event,
    ToolParser,
)
from tokenwise.entrypoints.openai.tool_parsers.harmony import (
    FUNCTIONS_PREFIX,
    Body,
    HarmonyEvent,
    HarmonyLexer,
    MessageEnd,
    MessageStart,
    Outside,
    Separator,
    route,
)


class OpenAIToolParser(ToolParser):
    name = "openai"
    needs_special_tokens = True

    def __init__(self, tools=None) -> None:
        super().__init__(tools)
        self._lexer = HarmonyLexer()
        self._kind = "content"
        self._content = Separator()
        self._has_args = False

    def feed(self, text: str) -> list[Event]:
        return self._read(self._lexer.feed(text))

    def finish(self) -> list[Event]:
        return self._read(self._lexer.finish())

    def _read(self, events: list[HarmonyEvent]) -> list[Event]:
        out: list[Event] = []
        for event in events:
            if isinstance(event, Outside):
                out.append(Content(event.text))
            elif isinstance(event, MessageStart):
                self._start(event, out)
            elif isinstance(event, Body):
                self._body(event.text, out)
            elif isinstance(event, MessageEnd):
                if self._kind == "call" and not self._has_args:
                    out.append(ArgsPiece("{}"))
                elif self._kind == "tool" and event.marker:
                    out.append(Content(event.marker))
                self._kind = "content"
        return out

    def _start(self, start: MessageStart, out: list[Event]) -> None:
        self._kind = route(start)
        if self._kind == "call":
            assert start.recipient is not None
            out.append(CallStart(start.recipient.removeprefix(FUNCTIONS_PREFIX)))
            self._has_args = False
        elif self._kind == "tool":
            out.append(Content(start.raw))
        elif self._kind == "content":
            self._content.start()

    def _body(self, text: str, out: list[Event]) -> None:
        if self._kind == "call":
            out.append(ArgsPiece(text))
            self._has_args = self._has_args or bool(text.strip())
        elif self._kind == "tool":
            out.append(Content(text))
        elif self._kind == "content":
            piece = self._content.before(text)
            if piece:
                out.append(Content(piece))
