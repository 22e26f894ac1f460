"""Score and classify requests: text pairs in, cross-encoder prompts out, and results back.

Shared by `LLM.score` / `LLM.classify` and the server's `/v1/score`, `/v1/rerank` and
`/v1/classify`, so both agree on pairing, tokenization and every number.

Pairing follows vLLM: one text against one (1:1), one against many (1:N), or two lists of the
same length, zipped (N:N). A pair is tokenized as the model was trained to read it, by the
checkpoint's tokenizer called with both texts (`[CLS] a [SEP] b [SEP]` for BERT, `<s> a </s></s>
b </s>` for XLM-RoBERTa); token types go with it when the model has more than one
(`type_vocab_size`; the engine packs them into the ids, `models/token_types.py`).

The engine's pooled vector of a classifier is its label probabilities (`pooling/classifier.py`);
here it becomes a `ScoringRequestOutput` (the single label's probability) or a
`ClassificationRequestOutput` (all of them). An embedding model scores too, as in vLLM: each
distinct text is embedded once and a pair's score is the cosine similarity of its two
embeddings (a bi-encoder: cheaper than a cross-encoder, and usually less accurate).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from tokenwise.engine.prompts import check_text
from tokenwise.model_config import ModelConfig
from tokenwise.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)


class ScoringInputError(ValueError):
    """Bad score / rerank input; `param` names the request field (text_1, documents, ...)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_task(model: ModelConfig, tasks: tuple[str, ...], what: str) -> None:
    """Refuse `what` (an API) unless the engine runs one of `tasks`, naming the one it runs."""
    if model.task not in tasks:
        wanted = " or ".join(f"task={t!r}" for t in tasks)
        raise ValueError(
            f"{what} needs a model loaded with {wanted}; {model.model!r} runs task={model.task!r}"
        )


def _texts(value: Any, name: str) -> list[str]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not items:
        raise ScoringInputError(f"{name} must be a string or a non-empty list of strings", name)
    for i, item in enumerate(items):
        where = name if isinstance(value, str) else f"{name}[{i}]"
        if not isinstance(item, str):
            raise ScoringInputError(f"{where} must be a string, got {type(item).__name__}", name)
        if not item:
            raise ScoringInputError(f"{where} is an empty string; every text needs content", name)
        try:
            check_text(item, where)
        except ValueError as exc:
            raise ScoringInputError(str(exc), name) from None
    return list(items)


def score_pairs(
    text_1: str | Sequence[str],
    text_2: str | Sequence[str],
    names: tuple[str, str] = ("text_1", "text_2"),
) -> list[tuple[str, str]]:
    """The (first, second) pairs to score: 1:1, 1:N or N:N, as vLLM pairs them."""
    first, second = _texts(text_1, names[0]), _texts(text_2, names[1])
    if len(first) == 1:
        return [(first[0], s) for s in second]
    if len(first) != len(second):
        raise ScoringInputError(
            f"{names[0]} has {len(first)} texts and {names[1]} {len(second)}: pair one with "
            "many (1:N) or two lists of the same length (N:N)",
            names[1],
        )
    return list(zip(first, second, strict=True))


def pair_prompt(tokenizer: Any, hf_config: Any, first: str, second: str) -> dict[str, Any]:
    """The engine prompt of one pair: its token ids, and its token types if the model has any."""
    if tokenizer is None:
        raise ValueError("scoring text pairs needs a tokenizer (skip_tokenizer_init is set)")
    typed = int(getattr(hf_config, "type_vocab_size", 1) or 1) > 1
    # Asked for explicitly: a tokenizer whose model_input_names omit them still computes them.
    encoded = tokenizer(first, second, return_token_type_ids=typed)
    prompt: dict[str, Any] = {"prompt_token_ids": list(encoded["input_ids"])}
    if typed and encoded.get("token_type_ids") is not None:
        prompt["token_type_ids"] = list(encoded["token_type_ids"])
    return prompt


def to_score(out: EmbeddingRequestOutput) -> ScoringRequestOutput:
    """A single-label classifier's pooled output as the pair's score (empty on an error)."""
    vector = out.outputs.embedding
    return ScoringRequestOutput(
        out.request_id,
        ScoringOutput(float(vector[0]) if vector else float("nan")),
        out.prompt_token_ids,
        out.finished,
        out.error or (None if vector else "the request was aborted"),
    )


def to_classification(out: EmbeddingRequestOutput) -> ClassificationRequestOutput:
    """A classifier's pooled output as class probabilities."""
    return ClassificationRequestOutput(
        out.request_id,
        ClassificationOutput(list(out.outputs.embedding)),
        out.prompt_token_ids,
        out.finished,
        out.error or (None if out.outputs.embedding else "the request was aborted"),
    )


def distinct_texts(pairs: Sequence[tuple[str, str]]) -> tuple[list[str], list[tuple[int, int]]]:
    """The texts an embedding model embeds to score `pairs` (each once: a 1:N query is embedded
    one time), and each pair's two positions in that list."""
    texts: list[str] = []
    position: dict[str, int] = {}
    index = []
    for pair in pairs:
        where = []
        for text in pair:
            if text not in position:
                position[text] = len(texts)
                texts.append(text)
            where.append(position[text])
        index.append((where[0], where[1]))
    return texts, index


def cosine_score(
    request_id: str, first: EmbeddingRequestOutput, second: EmbeddingRequestOutput
) -> ScoringRequestOutput:
    """A pair's score from two embeddings: their cosine similarity, in [-1, 1]."""
    error = first.error or second.error
    if error is None and not (first.outputs.embedding and second.outputs.embedding):
        error = "the request was aborted"
    score = float("nan")
    if error is None:
        a, b = (torch.tensor(o.outputs.embedding) for o in (first, second))
        score = float(F.cosine_similarity(a, b, dim=0))
    tokens = first.prompt_token_ids + second.prompt_token_ids
    return ScoringRequestOutput(request_id, ScoringOutput(score), tokens, True, error)
