"""Reasoning parsers: a reply's `<think>...</think>` part as `reasoning_content`, apart from its
content (`tokenwise serve --reasoning-parser NAME`, vLLM's names).

Reasoning models write their chain of thought between `<think>` and `</think>` before the
answer. Clients built for them (OpenAI's `reasoning_content`, as vLLM and DeepSeek's API send
it) show the two apart and feed only the content back into the conversation, so the server
splits them; tool calls are then read from the content alone (`tool_calls`).

- `deepseek_r1`: the reply starts *inside* the reasoning: DeepSeek-R1's newer chat templates
  end the prompt with `<think>\\n`, so the model writes no opening tag (an opening tag at the
  very start is skipped all the same). Everything up to `</think>` is reasoning, what follows is
  content; a reply that never closes the tag is all reasoning.
- `qwen3`: reasoning only where the model opens it: text before `<think>` and after `</think>`
  is content, and a reply without `<think>` (Qwen3 with `enable_thinking: false`) is all content.
- `openai_gptoss`: gpt-oss's harmony messages (`tool_parsers.harmony`) instead of tags: the
  `analysis` channel is the reasoning, `final` messages and commentary preambles the content
  (several of a kind joined by a newline). A message addressed to a tool stays in the content
  as harmony text, for the tool-call parser `openai` to read. Its markers are special tokens,
  so replies it reads are decoded with them kept.

With tags, only the first reasoning block counts: tags after it are ordinary content.
Whitespace between a tag and the text is dropped (the reasoning is trimmed, the content after
`</think>` starts at its first visible character), as chat UIs show neither.

One incremental parser serves both shapes of response, so they cannot disagree: a stream feeds
it each delta and sends what it returns at once, a collected response feeds the whole text.
What could still be the start of a tag (`<thi` at the end of a delta) or whitespace that may
turn out to precede `</think>` is held back until the next delta decides, and released by
`finish()` when the reply ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tokenwise.entrypoints.openai.tool_parsers import harmony

OPEN_TAG = "<think>"
CLOSE_TAG = "</think>"


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


def partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningParser:
    """Feed text as it arrives; each `feed` returns the reasoning and content now certain."""

    # True: the reply begins inside the reasoning (no opening tag needed).
    starts_in_reasoning: ClassVar[bool]
    # The format's markers are special tokens that decoding would otherwise drop.
    needs_special_tokens: ClassVar[bool] = False

    def __init__(self) -> None:
        self._mode = "reasoning" if self.starts_in_reasoning else "before"
        self._buffer = ""
        self._trim_start = self.starts_in_reasoning  # drop whitespace before the next text
        self._may_open = self.starts_in_reasoning  # an opening tag here is skipped

    def feed(self, text: str) -> ReasoningDelta:
        out = ReasoningDelta()
        self._buffer += text
        while self._step(out):
            pass
        return out

    def finish(self) -> ReasoningDelta:
        """The text held back, once the reply has ended (no tag can complete any more)."""
        out = ReasoningDelta()
        rest, self._buffer = self._buffer, ""
        if self._mode == "reasoning":
            out.reasoning = rest.rstrip()
        else:
            out.content = rest
        return out

    def _step(self, out: ReasoningDelta) -> bool:
        """Consume what the buffer decides; True while another step may consume more."""
        if self._trim_start:
            self._buffer = self._buffer.lstrip()
            if not self._buffer:
                return False
            self._trim_start = False
        if self._mode == "before":
            return self._before(out)
        if self._mode == "reasoning":
            return self._reasoning(out)
        out.content += self._buffer
        self._buffer = ""
        return False

    def _before(self, out: ReasoningDelta) -> bool:
        start = self._buffer.find(OPEN_TAG)
        if start < 0:
            cut = len(self._buffer) - partial_tag_len(self._buffer, OPEN_TAG)
            out.content += self._buffer[:cut]
            self._buffer = self._buffer[cut:]
            return False
        out.content += self._buffer[:start]
        self._buffer = self._buffer[start + len(OPEN_TAG) :]
        self._mode, self._trim_start = "reasoning", True
        return True

    def _reasoning(self, out: ReasoningDelta) -> bool:
        if self._may_open:
            if self._buffer.startswith(OPEN_TAG):
                self._buffer = self._buffer[len(OPEN_TAG) :]
                self._may_open, self._trim_start = False, True
                return True
            if OPEN_TAG.startswith(self._buffer):
                return False  # a partial opening tag: wait for more
            self._may_open = False
        end = self._buffer.find(CLOSE_TAG)
        if end >= 0:
            out.reasoning += self._buffer[:end].rstrip()
            self._buffer = self._buffer[end + len(CLOSE_TAG) :]
            self._mode, self._trim_start = "after", True
            return True
        # Hold back a partial closing tag and the whitespace before it (it may end the
        # reasoning, which is trimmed); release the rest.
        head = self._buffer[: len(self._buffer) - partial_tag_len(self._buffer, CLOSE_TAG)]
        certain = head.rstrip()
        out.reasoning += certain
        self._buffer = self._buffer[len(certain) :]
        return False


class DeepSeekR1ReasoningParser(ReasoningParser):
    starts_in_reasoning = True


class Qwen3ReasoningParser(ReasoningParser):
    starts_in_reasoning = False


class GptOssReasoningParser(ReasoningParser):
    """Harmony messages by channel; calls passed on as written (with an end token where the
    next message began without one, so that the tool-call parser sees where each ends)."""

    starts_in_reasoning = False
    needs_special_tokens = True

    def __init__(self) -> None:
        self._lexer = harmony.HarmonyLexer()
        self._kind = "content"
        self._joins = {"reasoning": harmony.Separator(), "content": harmony.Separator()}

    def feed(self, text: str) -> ReasoningDelta:
        return self._read(self._lexer.feed(text), ended=False)

    def finish(self) -> ReasoningDelta:
        return self._read(self._lexer.finish(), ended=True)

    def _read(self, events: list[harmony.HarmonyEvent], ended: bool) -> ReasoningDelta:
        out = ReasoningDelta()
        for event in events:
            if isinstance(event, harmony.Outside):
                out.content += event.text
            elif isinstance(event, harmony.MessageStart):
                self._kind = harmony.route(event)
                if self._kind in self._joins:
                    self._joins[self._kind].start()
                else:
                    out.content += event.raw
            elif isinstance(event, harmony.Body):
                if self._kind == "reasoning":
                    out.reasoning += self._joins["reasoning"].before(event.text)
                elif self._kind == "content":
                    out.content += self._joins["content"].before(event.text)
                else:
                    out.content += event.text
            elif isinstance(event, harmony.MessageEnd):
                if self._kind not in self._joins:
                    out.content += event.marker or ("" if ended else harmony.END)
                self._kind = "content"
        return out


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
    "openai_gptoss": GptOssReasoningParser,
}


def check_reasoning_parser(name: str | None) -> None:
    """A clear error for an unknown `--reasoning-parser`, listing the valid names."""
    if name is not None and name not in REASONING_PARSERS:
        raise ValueError(
            f"unknown reasoning parser {name!r}; choose one of {sorted(REASONING_PARSERS)}"
        )


def split_reasoning(parser: ReasoningParser, text: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole reply; None for a part that is empty (reasoning is None
    also when the reply has no reasoning part at all)."""
    first, last = parser.feed(text), parser.finish()
    reasoning = first.reasoning + last.reasoning
    content = first.content + last.content
    return (reasoning or None), (content or None)
