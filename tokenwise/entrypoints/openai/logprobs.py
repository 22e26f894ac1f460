"""The engine's per-token logprobs in the two shapes the OpenAI API uses.

The engine gives, per generated token, a dict token id -> Logprob holding the sampled token and
the top-N alternatives (rank 1 = most likely). Legacy completions want parallel lists
(`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`) where `top_logprobs` may hold N + 1
entries (the sampled token is always included); chat wants a list of objects whose
`top_logprobs` are exactly the N most likely tokens, each with its UTF-8 bytes.
"""

from __future__ import annotations

from collections.abc import Callable

from tokenwise.entrypoints.openai.protocol import (
    ChatLogprobs,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobsField,
    TokenLogprob,
    TopLogprob,
)
from tokenwise.outputs import Logprob, PromptLogprobs, SampleLogprobs


def _text(token_id: int, logprob: Logprob | None) -> str:
    # Without a tokenizer the engine cannot decode; vLLM's convention names the id instead.
    if logprob is None or logprob.decoded_token is None:
        return f"token_id:{token_id}"
    return logprob.decoded_token


def completion_logprobs(
    token_ids: list[int],
    logprobs: list[dict[int, Logprob] | None],
    offset: int,
    decode: Callable[[int], str] | None = None,
) -> tuple[CompletionLogprobs, int]:
    """Logprobs of `token_ids`, whose text starts at character `offset` of the completion;
    also returns the offset after them (a stream continues from there in its next chunk).

    An entry may be None (an echoed prompt's first token: nothing comes before it): its
    logprob and top logprobs are null and its text comes from `decode`, when given."""
    out = CompletionLogprobs()
    for token_id, entry in zip(token_ids, logprobs, strict=False):
        if entry is None:
            text = decode(token_id) if decode is not None else _text(token_id, None)
            out.tokens.append(text)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            chosen = entry.get(token_id)
            text = _text(token_id, chosen)
            out.tokens.append(text)
            out.token_logprobs.append(chosen.logprob if chosen is not None else None)
            out.top_logprobs.append(_top_dict(entry))
        out.text_offset.append(offset)
        offset += len(text)
    return out, offset


def _by_rank(entry: dict[int, Logprob]) -> list[tuple[int, Logprob]]:
    return sorted(entry.items(), key=lambda item: (item[1].rank is None, item[1].rank or 0))


def _top_dict(entry: dict[int, Logprob]) -> dict[str, float]:
    # Distinct ids can decode to the same text (e.g. partial UTF-8 -> "\ufffd"); the dict
    # keeps the likeliest, so the sampled token of a greedy step is still the maximum.
    top: dict[str, float] = {}
    for t, lp in _by_rank(entry):
        top.setdefault(_text(t, lp), lp.logprob)
    return top


def _top(entry: dict[int, Logprob], top_n: int) -> list[TopLogprob]:
    ranked = sorted(
        (lp.rank, t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= top_n
    )
    return [
        TopLogprob(token=_text(t, lp), logprob=lp.logprob, bytes=list(_text(t, lp).encode()))
        for _, t, lp in ranked
    ]


def chat_logprobs(token_ids: list[int], logprobs: SampleLogprobs, top_n: int) -> ChatLogprobs:
    content = []
    for token_id, entry in zip(token_ids, logprobs, strict=False):
        chosen = entry.get(token_id)
        text = _text(token_id, chosen)
        content.append(
            TokenLogprob(
                token=text,
                logprob=chosen.logprob if chosen is not None else float("-inf"),
                bytes=list(text.encode()),
                top_logprobs=_top(entry, top_n),
            )
        )
    return ChatLogprobs(content=content)


def prompt_logprobs_field(logprobs: PromptLogprobs | None) -> PromptLogprobsField:
    """The engine's prompt logprobs in vLLM's response shape (token ids as keys)."""
    if logprobs is None:
        return None
    return [
        None
        if entry is None
        else {
            t: PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=lp.decoded_token)
            for t, lp in entry.items()
        }
        for entry in logprobs
    ]
