"""`deepseek_v3`: DeepSeek-V3 / R1 (0528) tool calls, as their chat template writes them:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME2 ...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

(The bars and the `▁` are the full-width `｜` U+FF5C and U+2581, as in DeepSeek's vocabulary.)
Text before `<｜tool▁calls▁begin｜>` and after `<｜tool▁calls▁end｜>` is content. The name is
reported at the newline after it, and the arguments stream as they arrive, up to the closing
fence. A section that breaks the pattern is not read further: the rest of it is content.
"""

from __future__ import annotations

from tokenwise.entrypoints.openai.tool_parsers.base import (
    CallStart,
    Content,
    Event,
    ToolParser,
)

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
FENCE_OPEN = "```json"
FENCE_CLOSE = "\n```"


class DeepSeekV3ToolParser(ToolParser):
    name = "deepseek_v3"

    def __init__(self, tools=None) -> None:
        super().__init__(tools)
        # "content", "section" (before a call or the section's end), "header" (type, name),
        # "fence" (before the arguments), "args", "call_end"
        self._mode = "content"

    def _step(self, out: list[Event], final: bool) -> bool:
        return getattr(self, "_" + self._mode)(out, final)

    def _content(self, out: list[Event], final: bool) -> bool:
        if not self._content_until(CALLS_BEGIN, out, final):
            return False
        self._mode = "section"
        return True

    def _expect(self, out: list[Event], final: bool, tags: dict[str, str]) -> bool:
        """After optional whitespace, one of `tags` (tag -> next mode); anything else ends the
        section, its text becoming content."""
        head = self._buffer.lstrip()
        for tag, mode in tags.items():
            if head.startswith(tag):
                self._buffer, self._mode = head[len(tag) :], mode
                return True
        if not final and (not head or any(t.startswith(head) for t in tags)):
            return False
        self._buffer, self._mode = head, "content"
        if head:
            out.append(Content(head))
            self._buffer = ""
        return False

    def _section(self, out: list[Event], final: bool) -> bool:
        return self._expect(out, final, {CALL_BEGIN: "header", CALLS_END: "content"})

    def _header(self, out: list[Event], final: bool) -> bool:
        sep = self._buffer.find(SEP)
        newline = self._buffer.find("\n", sep + len(SEP)) if sep >= 0 else -1
        if newline < 0:
            if final:
                return self._expect(out, final, {})
            return False
        name = self._buffer[sep + len(SEP) : newline].strip()
        out.append(CallStart(name))
        self._buffer, self._mode = self._buffer[newline + 1 :], "fence"
        return True

    def _fence(self, out: list[Event], final: bool) -> bool:
        head = self._buffer.lstrip()
        if head.startswith(FENCE_OPEN + "\n") or (final and head == FENCE_OPEN):
            self._buffer, self._mode = head[len(FENCE_OPEN) + 1 :], "args"
            return True
        if not final and (FENCE_OPEN + "\n").startswith(head):
            return False
        self._buffer, self._mode = head, "args"  # arguments without a fence
        return True

    def _args(self, out: list[Event], final: bool) -> bool:
        tag = self._stream_args(out, final, (FENCE_CLOSE, CALL_END))
        if tag is None:
            return False
        self._mode = "call_end" if tag == FENCE_CLOSE else "section"
        return True

    def _call_end(self, out: list[Event], final: bool) -> bool:
        return self._expect(out, final, {CALL_END: "section"})
