"""Prompt inputs, the tokenizer, and end-of-sequence ids: validated before anything is queued."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from tokenwise.model_config import ModelConfig
from tokenwise.sampling.guided.grammar import build_grammar
from tokenwise.sampling.params import SamplingParams

# A string, a list of token ids, or {"prompt_token_ids": [...]} / {"prompt": "..."} as in vLLM.
PromptInput = str | list[int] | dict[str, Any]

# Families whose replies end at tokens a checkpoint may not list as EOS: gpt-oss's harmony ends
# a reply with <|return|> and a tool call with <|call|> (as vLLM stops it, whatever
# generation_config.json says).
_FAMILY_STOP_TOKENS = {"gpt_oss": ("<|return|>", "<|call|>")}


def load_tokenizer(model_config: ModelConfig) -> Any:
    """The checkpoint's tokenizer through transformers' AutoTokenizer, offline."""
    from transformers import AutoTokenizer

    path = model_config.tokenizer or model_config.model
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"could not load a tokenizer from {path!r} ({exc}); pass skip_tokenizer_init=True "
            "and give prompts as token ids to run without one"
        ) from exc


def resolve_eos_token_ids(model_config: ModelConfig, tokenizer: Any) -> tuple[int, ...]:
    """EOS ids from the tokenizer, config.json and generation_config.json (Llama 3 has several),
    and the family's own stop tokens (`_FAMILY_STOP_TOKENS`) where the tokenizer has them."""
    ids: list[int] = []

    def add(value: Any) -> None:
        values = value if isinstance(value, (list, tuple)) else [value]
        for v in values:
            if isinstance(v, int) and v >= 0 and v not in ids:
                ids.append(v)

    if tokenizer is not None:
        add(getattr(tokenizer, "eos_token_id", None))
    add(getattr(model_config.hf_config, "eos_token_id", None))
    gen_path = os.path.join(model_config.model, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            add(json.load(f).get("eos_token_id"))
    stops = _FAMILY_STOP_TOKENS.get(getattr(model_config.hf_config, "model_type", None), ())
    if stops and tokenizer is not None:
        vocab = tokenizer.get_vocab()
        add([vocab[t] for t in stops if t in vocab])
    return tuple(ids)


def to_token_ids(
    prompt: PromptInput, tokenizer: Any, vocab_size: int
) -> tuple[str | None, list[int]]:
    """(prompt text or None, token ids), with clear errors for every malformed input."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), _check_ids(prompt["prompt_token_ids"], vocab_size)
        if "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise ValueError("a dict prompt needs a 'prompt_token_ids' or 'prompt' key")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(
                "text prompts need a tokenizer, but the engine was started with "
                "skip_tokenizer_init=True; pass token ids instead"
            )
        if not prompt:
            raise ValueError("prompt must not be empty")
        check_text(prompt, "prompt")
        return prompt, _check_ids(tokenizer.encode(prompt), vocab_size)
    if isinstance(prompt, (list, tuple)):
        return None, _check_ids(prompt, vocab_size)
    raise TypeError(
        "prompt must be a string, a list of token ids or a dict with 'prompt_token_ids', "
        f"got {type(prompt).__name__}"
    )


def check_text(text: str, what: str) -> None:
    """Refuse a str that UTF-8 cannot encode: one holding a lone UTF-16 surrogate, which JSON
    lets a client send as an unpaired escape ("\\ud800"). Tokenizers fail on it with a TypeError
    that names neither the input nor the character."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        # repr() escapes the surrogate, so the message itself stays encodable.
        raise ValueError(
            f"{what} must be valid Unicode text, but holds the lone surrogate {text[exc.start]!r}"
        ) from None


def _check_ids(ids: Any, vocab_size: int) -> list[int]:
    if not isinstance(ids, (list, tuple)) or not ids:
        raise ValueError("prompt_token_ids must be a non-empty list of integers")
    out = []
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int):
            raise ValueError(f"prompt_token_ids must hold integers, got {t!r}")
        if not 0 <= t < vocab_size:
            raise ValueError(f"prompt token id {t} is out of range [0, {vocab_size})")
        out.append(t)
    return out


def validate_request(
    model_config: Any, tokenizer: Any, prompt: PromptInput, params: SamplingParams
) -> tuple[str | None, list[int]]:
    """Tokenize and check a request against this model; `(prompt text, token ids)`.

    A function rather than an engine method so that a front end without a model (the
    data-parallel client) refuses bad input exactly as an engine would, before choosing a rank.
    What SamplingParams cannot check alone is checked here: limits set by this model and
    tokenizer. Without these checks a bad value would only fail inside a batched step.
    """
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
    vocab = model_config.vocab_size
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > vocab:
            raise ValueError(f"{name}={value} exceeds the vocabulary size {vocab}")
    for name, ids in (
        ("stop_token_ids", params.stop_token_ids),
        ("logit_bias", params.logit_bias),
        ("allowed_token_ids", params.allowed_token_ids),
    ):
        bad = sorted({t for t in ids or () if t >= vocab})
        if bad:
            raise ValueError(f"{name} token ids {bad} are out of range [0, {vocab})")
    if params.bad_words:
        if tokenizer is None:
            raise ValueError(
                "bad_words need a tokenizer, but the engine was started with "
                "skip_tokenizer_init=True; use logit_bias to ban token ids instead"
            )
        for word in params.bad_words:
            check_text(word, "bad_words")
        params.resolve_bad_words(tokenizer)
    if params.stop and tokenizer is None:
        raise ValueError(
            "stop strings need a tokenizer, but the engine was started with "
            "skip_tokenizer_init=True; use stop_token_ids instead"
        )
    if params.guided_decoding is not None:
        if tokenizer is None:
            raise ValueError(
                "guided_decoding needs a tokenizer, but the engine was started with "
                "skip_tokenizer_init=True"
            )
        build_grammar(params.guided_decoding)  # an invalid spec fails here, by name
    text, token_ids = to_token_ids(prompt, tokenizer, vocab)
    text, token_ids = _truncate(text, token_ids, params, tokenizer, model_config.max_model_len)
    if len(token_ids) >= model_config.max_model_len:
        raise ValueError(
            f"prompt has {len(token_ids)} tokens, but max_model_len is "
            f"{model_config.max_model_len} (the prompt plus at least one generated "
            "token must fit)"
        )
    return text, token_ids


def _truncate(
    text: str | None,
    token_ids: list[int],
    params: SamplingParams,
    tokenizer: Any,
    max_model_len: int,
) -> tuple[str | None, list[int]]:
    """`truncate_prompt_tokens`: keep the prompt's last N tokens (-1: the most the model takes
    with room for one generated token). A cut text prompt's text becomes its kept tokens'
    text, so an echo shows what the model read."""
    keep = params.truncate_prompt_tokens
    if keep is None:
        return text, token_ids
    if keep == -1:
        keep = max_model_len - 1
    if len(token_ids) <= keep:
        return text, token_ids
    token_ids = token_ids[-keep:]
    if text is not None:
        text = tokenizer.decode(token_ids) if tokenizer is not None else None
    return text, token_ids


def as_prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    """A single prompt (a string, a dict or one token-id list) becomes a list of one."""
    if isinstance(prompts, (str, dict)) or (
        isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)
    ):
        return [prompts]  # type: ignore[list-item]
    return list(prompts)  # type: ignore[arg-type]
