"""Incremental detokenization and stop-string handling for one sequence.

Decoding the whole output every step is quadratic, and decoding single tokens breaks multi-byte
characters and leading spaces. So each step decodes only a short window: the text of
`tokens[prefix:]` minus the text of `tokens[prefix:read]`; the window starts with a few prompt
tokens so tokenizers that drop a leading space on the first token still render it. Text ending
in U+FFFD (an incomplete UTF-8 sequence) is held back until the next token completes it.

Stop strings are searched in the new text (plus the few characters before it a stop could span),
and text that could still turn out to be the start of a stop string is not released yet.
"""

from __future__ import annotations

from typing import Any

_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        context = prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]
        self.tokens: list[int] = list(context)
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.output_text = ""
        self.sent_offset = 0  # characters of output_text already returned to the caller
        self.stop = [s for s in (stop or []) if s]
        self.include_stop = include_stop_str_in_output
        self.skip_special_tokens = skip_special_tokens
        self.hold_back = max((len(s) for s in self.stop), default=1) - 1

    @classmethod
    def from_params(cls, tokenizer: Any, prompt_token_ids: list[int], params: Any) -> Any:
        """The detokenizer of a request with these SamplingParams (stop strings, specials)."""
        return cls(
            tokenizer,
            prompt_token_ids,
            params.stop,
            params.include_stop_str_in_output,
            params.skip_special_tokens,
        )

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> str | None:
        """Append one token; returns the stop string if the text now contains one."""
        self.tokens.append(token_id)
        prefix_text = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.tokens[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return None
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.tokens)
        search_from = max(0, len(self.output_text) - self.hold_back)
        self.output_text += delta
        # The earliest match wins, whatever the order of the stop list ("the" with stops
        # ["e", "h"] stops at "t"); among matches at one position, the longer one.
        found = [
            (at, -len(stop), stop)
            for stop in self.stop
            if (at := self.output_text.find(stop, search_from)) >= 0
        ]
        if not found:
            return None
        at, _, stop = min(found)
        end = at + len(stop) if self.include_stop else at
        self.output_text = self.output_text[:end]
        return stop

    def take_new_text(self, finished: bool) -> str:
        """Text not yet returned; while running, keep back what could begin a stop string."""
        end = len(self.output_text)
        if not finished and self.stop:
            end = max(self.sent_offset, end - self.hold_back)
        text = self.output_text[self.sent_offset : end]
        self.sent_offset = end
        return text
