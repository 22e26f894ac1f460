"""Incremental detokenization and stop-string handling for one sequence.

Decoding the whole output every step is quadratic, and decoding single tokens breaks multi-byte
characters and leading spaces. So each step decodes only a short window: the text of
`tokens[prefix:]` minus the text of `tokens[prefix:read]`; the window starts with a few prompt
tokens so tokenizers that drop a leading space on the first token still render it. Text ending
in U+FFFD (an incomplete UTF-8 sequence) is held back until the next token completes it; a
character cut off by the end of generation is never emitted (as in vLLM). So a finished
sequence's text is `decode(all its tokens).rstrip("\ufffd")`, cut at the first stop string
(tests/engine/test_detokenizer.py checks this on random tokens, for both decoders).

Two decoders run that window, with identical output:

- `_StreamDecoder`, for fast (Rust-backed) tokenizers: `tokenizers`' own `DecodeStream`, which
  runs the window in Rust and keeps the previous window's text instead of decoding it again,
  so one token costs one call into Rust (what vLLM V1 does for fast tokenizers);
- `_PrefixWindowDecoder`, the same algorithm in Python over `tokenizer.decode`, for everything
  else: slow (pure-Python) tokenizers have no Rust backend to stream from; a `tokenizers`
  release without `DecodeStream` (before 0.21) has nothing to call; and a tokenizer whose
  `decode` post-processes the backend's text (`clean_up_tokenization_spaces` in effect, or a
  class that overrides `decode`) would give different text from the backend's stream.

Stop strings are searched in the new text (plus the few characters before it a stop could span),
and text that could still turn out to be the start of a stop string is not released yet.
"""

from __future__ import annotations

from typing import Any

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21
    DecodeStream = None

_PROMPT_CONTEXT_TOKENS = 5
# tokenizers' DecodeStream raises this (a plain Exception) when a window's text no longer starts
# with the previous window's text, which some tokenizers' non-monotonic UTF-8 output can cause
# (vllm-project/vllm#17448); the stream cannot go on from that state.
_INVALID_PREFIX_ERROR = "Invalid prefix encountered"


def decode_stream_unsupported_reason(tokenizer: Any) -> str | None:
    """Why `DecodeStream` cannot reproduce `tokenizer.decode` for this tokenizer (None: it can).

    The stream decodes with the Rust backend directly, so it matches `tokenizer.decode` only
    when that is the backend's decode and nothing more.
    """
    if DecodeStream is None:
        return "tokenizers has no DecodeStream (it needs tokenizers >= 0.21)"
    from transformers import PreTrainedTokenizerFast
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        return f"{type(tokenizer).__name__} is not a fast tokenizer (no Rust backend to stream)"
    cls = type(tokenizer)
    if (
        cls.decode is not PreTrainedTokenizerBase.decode
        or cls._decode is not PreTrainedTokenizerFast._decode
    ):
        return f"{cls.__name__} overrides decode"
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        # transformers skips the clean-up for BPE models unless forced (it removes real spaces).
        is_bpe = type(tokenizer.backend_tokenizer.model).__name__ == "BPE"
        forced = getattr(
            tokenizer,
            "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output",
            False,
        )
        if not is_bpe or forced:
            return "clean_up_tokenization_spaces edits decode's text after the backend"
    return None


class _PrefixWindowDecoder:
    """The window algorithm in Python over `tokenizer.decode` (any tokenizer)."""

    def __init__(self, tokenizer: Any, context: list[int], skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens: list[int] = list(context)
        self.prefix_offset = 0
        self.read_offset = len(context)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def step(self, token_id: int) -> str | None:
        """The text `token_id` completes, or None while it completes none."""
        self.tokens.append(token_id)
        prefix_text = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.tokens[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return None
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.tokens)
        return new_text[len(prefix_text) :]


class _StreamDecoder:
    """The window algorithm in Rust: `tokenizers.decoders.DecodeStream` (fast tokenizers)."""

    def __init__(self, tokenizer: Any, context: list[int], skip_special_tokens: bool) -> None:
        self.backend = tokenizer.backend_tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stream = DecodeStream(context, skip_special_tokens=skip_special_tokens)
        # The tokens fed since the stream last returned text (it keeps its own copy private),
        # to start a fresh stream from after an invalid-prefix error.
        self.pending: list[int] = []

    def step(self, token_id: int) -> str | None:
        """The text `token_id` completes, or None while it completes none."""
        self.pending.append(token_id)
        try:
            text = self.stream.step(self.backend, token_id)
        except Exception as exc:
            if not str(exc).startswith(_INVALID_PREFIX_ERROR):
                raise
            # Start a fresh stream from the held-back tokens (vLLM's recovery): it loses only
            # the context a leading space may need, instead of failing the request.
            self.stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
            text = self.stream.step(self.backend, self.pending)
        if text is not None:
            self.pending = []
        return text


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        use_decode_stream: bool | None = None,
    ) -> None:
        """`use_decode_stream`: None picks `DecodeStream` whenever it reproduces
        `tokenizer.decode` (`decode_stream_unsupported_reason`); True insists (a ValueError
        says why it cannot), False keeps the Python decoder (benchmarks, tests)."""
        self.tokenizer = tokenizer
        context = prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]
        if use_decode_stream is not False:
            reason = decode_stream_unsupported_reason(tokenizer)
            if reason is not None and use_decode_stream:
                raise ValueError(f"cannot detokenize with DecodeStream: {reason}")
            use_decode_stream = reason is None
        decoder_cls = _StreamDecoder if use_decode_stream else _PrefixWindowDecoder
        self.decoder = decoder_cls(tokenizer, context, skip_special_tokens)
        self.uses_decode_stream = use_decode_stream
        self.output_text = ""
        self.sent_offset = 0  # characters of output_text already returned to the caller
        self.stop = [s for s in (stop or []) if s]
        self.include_stop = include_stop_str_in_output
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

    def add_token(self, token_id: int) -> str | None:
        """Append one token; returns the stop string if the text now contains one."""
        delta = self.decoder.step(token_id)
        if not delta:
            return None
        search_from = max(0, len(self.output_text) - self.hold_back)
        self.output_text += delta
        if not self.stop:
            return None
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
