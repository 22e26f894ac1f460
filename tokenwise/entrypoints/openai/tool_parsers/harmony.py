"""Reading OpenAI's harmony format (gpt-oss) out of generated text, incrementally.

gpt-oss writes its reply as a sequence of messages, each a header and a body between special
tokens (the decoded text must keep them: `skip_special_tokens=False`):

    <|start|>assistant<|channel|>analysis<|message|>chain of thought<|end|>
    <|start|>assistant<|channel|>final<|message|>the answer<|return|>
    <|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>
    {"city":"Paris"}<|call|>          (one line: the message's header, then its body)

The header holds the author's role (after `<|start|>`), the `<|channel|>` (analysis: reasoning;
commentary: tool calls and preambles; final: the answer), an optional recipient `to=NAME`
(before or after the channel: the model writes both) and an optional content type (after
`<|constrain|>`, or a bare word after the channel). The prompt ends with `<|start|>assistant`,
so the reply's first message begins at its `<|channel|>`: a `<|channel|>` outside a message
opens one, its author the assistant. `<|end|>` ends a message, `<|return|>` the reply and
`<|call|>` a tool call; the last two are stop tokens, hidden from the text, so a message may
also end where the text does. Text outside any message (a model that ignores the format) is
reported as it is.

`HarmonyLexer` turns text fed piece by piece into events; what could still be the start of a
special token (`<|cha` at the end of a piece) waits for the next piece, so the events never
depend on where the text was cut. The reasoning parser `openai_gptoss` (`reasoning`) and the
tool-call parser `openai` (`openai.py`, beside this module) both read these events; `route`
says what a message is to both of them, so they cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenwise.entrypoints.openai.tool_parsers.base import find_first, held_back

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
# What ends a body: its own end tokens, or (tolerated) the next message starting without one.
_BODY_ENDS = (END, RETURN, CALL, START, CHANNEL)
_OUTSIDE_OPENS = (START, CHANNEL)
FUNCTIONS_PREFIX = "functions."


@dataclass
class Outside:
    """Text outside any message, as written."""

    text: str


@dataclass
class MessageStart:
    """A complete header. `raw`: the header as written (up to and including `<|message|>`)."""

    role: str
    channel: str | None
    recipient: str | None
    content_type: str | None
    raw: str


@dataclass
class Body:
    text: str


@dataclass
class MessageEnd:
    """`marker`: the token that ended the message; "" when the text ended it, or the next
    message began without one."""

    marker: str


HarmonyEvent = Outside | MessageStart | Body | MessageEnd


def parse_header(raw: str, role: str) -> MessageStart:
    """The fields of a header as written: `raw` runs from just after `<|start|>` (the role
    first) or from its `<|channel|>` (`role` given), through `<|message|>`."""
    head = raw[: -len(MESSAGE)] if raw.endswith(MESSAGE) else raw
    head, _, constrained = head.partition(CONSTRAIN)
    before, has_channel, after = head.partition(CHANNEL)
    words = before.split()
    if words and not words[0].startswith("to="):
        role = words.pop(0)
    recipient: str | None = None
    channel: str | None = None
    content_type = constrained.strip() or None
    for i, word in enumerate(words + after.split()):
        if word.startswith("to="):
            recipient = word[3:] or None
        elif has_channel and channel is None and i >= len(words):
            channel = word
        elif content_type is None:
            content_type = word
    return MessageStart(role, channel, recipient, content_type, raw)


class HarmonyLexer:
    """Feed text as it arrives; each call returns the events that text settles."""

    def __init__(self) -> None:
        self._buffer = ""
        self._state = "outside"  # or "header", "body"
        self._opener = ""  # what opened the header: <|start|> or <|channel|>

    def feed(self, text: str) -> list[HarmonyEvent]:
        self._buffer += text
        out: list[HarmonyEvent] = []
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> list[HarmonyEvent]:
        """Events for what was held back, now that the text has ended: a body still open ends
        here; a header never completed is dropped (it said nothing yet)."""
        out: list[HarmonyEvent] = []
        while self._step(out, final=True):
            pass
        if self._state == "body":
            out.append(MessageEnd(""))
        self._state, self._buffer = "outside", ""
        return out

    def _step(self, out: list[HarmonyEvent], final: bool) -> bool:
        if self._state == "outside":
            return self._outside(out, final)
        if self._state == "header":
            return self._header(out)
        return self._body(out, final)

    def _text_until(
        self, tags: tuple[str, ...], kind: type[Outside] | type[Body], out: list, final: bool
    ) -> str | None:
        """Report the buffer as `kind` text up to the first of `tags`, which it then starts
        with (returned); None when no tag has come (a partial one held back unless `final`)."""
        found = None
        if "<" not in self._buffer:  # every harmony token starts with "<": all settled
            at = len(self._buffer)
        elif (found := find_first(self._buffer, tags)) is None:
            at = len(self._buffer) - (0 if final else held_back(self._buffer, tags))
        else:
            at = found[0]
        if at:
            out.append(kind(self._buffer[:at]))
        self._buffer = self._buffer[at:]
        return None if found is None else found[1]

    def _outside(self, out: list[HarmonyEvent], final: bool) -> bool:
        tag = self._text_until(_OUTSIDE_OPENS, Outside, out, final)
        if tag is None:
            return False
        self._open_header(tag)
        return True

    def _open_header(self, tag: str) -> None:
        """`<|start|>` is followed by the role; a bare `<|channel|>` stays in the header."""
        self._opener = tag
        if tag == START:
            self._buffer = self._buffer[len(START) :]
        self._state = "header"

    def _header(self, out: list[HarmonyEvent]) -> bool:
        end = self._buffer.find(MESSAGE)
        if end < 0:
            return False  # a header reports nothing until it is complete
        raw = self._buffer[: end + len(MESSAGE)]
        self._buffer = self._buffer[end + len(MESSAGE) :]
        start = parse_header(raw, "assistant")
        if self._opener == START:
            start.raw = START + raw
        out.append(start)
        self._state = "body"
        return True

    def _body(self, out: list[HarmonyEvent], final: bool) -> bool:
        tag = self._text_until(_BODY_ENDS, Body, out, final)
        if tag is None:
            return False
        if tag in _OUTSIDE_OPENS:  # the next message, begun without an end token
            out.append(MessageEnd(""))
            self._open_header(tag)
            return True
        self._buffer = self._buffer[len(tag) :]
        out.append(MessageEnd(tag))
        self._state = "outside"
        return True


def route(start: MessageStart) -> str:
    """What a message is: "call" (addressed to one of the request's functions), "tool" (to
    another recipient: a built-in tool this server does not run), "reasoning" (the analysis
    channel) or "content" (final answers and commentary preambles)."""
    if start.recipient is not None:
        return "call" if start.recipient.startswith(FUNCTIONS_PREFIX) else "tool"
    return "reasoning" if start.channel == "analysis" else "content"


class Separator:
    """Messages of one kind joined with a newline: the text to put before a message's first
    piece (a newline once an earlier message of the same kind had text)."""

    def __init__(self) -> None:
        self._seen = False
        self._fresh = True

    def start(self) -> None:
        self._fresh = True

    def before(self, text: str) -> str:
        if not text:
            return ""
        prefix = "\n" if self._seen and self._fresh else ""
        self._seen, self._fresh = True, False
        return prefix + text
