"""Fill-in-the-middle: `suffix` on `/v1/completions` for code models trained to fill a gap.

A FIM model reads the code before the gap, the code after it and a marker asking for the middle,
each introduced by a special token, and writes the middle. Two spellings of those tokens are in
use: Qwen2.5-Coder's and CodeGemma's `<|fim_prefix|>`, `<|fim_suffix|>`, `<|fim_middle|>`,
and StarCoder's (SantaCoder, StarCoder2) `<fim_prefix>`, `<fim_suffix>`, `<fim_middle>`. The prompt is prefix-suffix-middle (PSM), the order both were trained on:

    <fim_prefix> {prompt} <fim_suffix> {suffix} <fim_middle>

The prompt is assembled from token ids, not by tokenizing that text, so each marker is exactly
its one token whatever the text around it, and the code is tokenized as the model saw code.
A tokenizer without a complete set of markers has no way to ask for a middle, so `suffix` is
refused for it (a 400 naming `suffix`), rather than silently appended or ignored.
"""

from __future__ import annotations

from typing import Any

from tokenwise.engine.prompts import check_text
from tokenwise.entrypoints.openai.errors import OpenAIError

# (prefix, suffix, middle) marker spellings, in the order they are looked for.
FIM_SPELLINGS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
)


def fim_token_ids(tokenizer: Any) -> tuple[int, int, int] | None:
    """The ids of the tokenizer's (prefix, suffix, middle) markers, or None if it lacks a set.
    A marker counts only if it is one token of the vocabulary (not the unknown token)."""
    if tokenizer is None:
        return None
    vocab = tokenizer.get_vocab()
    for spelling in FIM_SPELLINGS:
        ids = [vocab.get(token) for token in spelling]
        if all(i is not None for i in ids):
            return ids[0], ids[1], ids[2]  # type: ignore[return-value]
    return None


def _refuse(reason: str) -> OpenAIError:
    return OpenAIError(400, f"suffix: {reason}", param="suffix", code="unsupported_parameter")


def fim_prompt(tokenizer: Any, prompt: Any, suffix: str, add_special_tokens: bool) -> dict:
    """The engine prompt that asks the model for the middle between `prompt` and `suffix`.

    With `add_special_tokens`, the tokenizer's BOS (if it adds one) comes first, as it would
    before a plain prompt."""
    markers = fim_token_ids(tokenizer)
    if markers is None:
        spelled = " / ".join(", ".join(s) for s in FIM_SPELLINGS)
        raise _refuse(
            "this model's tokenizer has no fill-in-the-middle tokens (it needs one of: "
            f"{spelled}), so it cannot fill a gap; leave suffix out or set it to null"
        )
    if not isinstance(prompt, str):
        raise _refuse("fill-in-the-middle needs a text prompt (a string), not token ids")
    for name, text in (("prompt", prompt), ("suffix", suffix)):
        try:
            check_text(text, name)
        except ValueError as exc:
            raise OpenAIError(400, str(exc), param=name) from exc
    prefix_id, suffix_id, middle_id = markers
    ids = [prefix_id]
    ids += tokenizer.encode(prompt, add_special_tokens=False)
    ids.append(suffix_id)
    ids += tokenizer.encode(suffix, add_special_tokens=False)
    ids.append(middle_id)
    bos = getattr(tokenizer, "bos_token_id", None)
    if add_special_tokens and bos is not None and tokenizer.encode("x")[:1] == [bos]:
        ids.insert(0, bos)
    text = tokenizer.decode(ids, skip_special_tokens=False)
    return {"prompt": text, "prompt_token_ids": ids}
