"""Which task an engine runs (generate, embed, score, classify), and the pooling it uses.

Resolved once, when the engine configuration is built, so the engine, the offline API and the
server all see the same answer, and a mismatch (embedding a generative model, generating with
an encoder) fails at start-up or on the first call with a message saying what to change.
"""

from __future__ import annotations

from dataclasses import replace

from tokenwise.config import PoolerConfig
from tokenwise.model_config import TASKS
from tokenwise.models.registry import (
    default_pooler_config,
    is_classifier_architecture,
    is_pooling_architecture,
)
from tokenwise.pooling.st_config import load_sentence_transformers_pooler

TASK_CHOICES = ("auto", *TASKS)


def resolve_task(task: str, architectures: list[str], num_labels: int = 2) -> str:
    """The task an engine runs. "auto" picks embed for encoder-only (pooling) architectures,
    score for a sequence classifier with one label (a cross-encoder or reward model), classify
    for one with several, and generate for the rest. `num_labels`: the classifier's."""
    if task not in TASK_CHOICES:
        raise ValueError(f"task must be one of {', '.join(TASK_CHOICES)}, got {task!r}")
    pooling = is_pooling_architecture(architectures)
    classifier = is_classifier_architecture(architectures)
    if task == "auto":
        if classifier:
            return "score" if num_labels == 1 else "classify"
        return "embed" if pooling else "generate"
    if task == "generate" and pooling:
        use = "task='score' or 'classify'" if classifier else "task='embed' (--task embed)"
        raise ValueError(
            f"architecture {architectures} is a pooling model and cannot generate text; use {use}"
        )
    if task == "embed" and classifier:
        raise ValueError(
            f"architecture {architectures} is a sequence classifier; use task='score' (text "
            "pairs, /v1/score, /v1/rerank) or task='classify' (/v1/classify)"
        )
    if task == "embed" and not pooling:
        raise ValueError(
            f"task='embed' is supported for encoder-only models (BERT, XLM-RoBERTa); "
            f"architecture {architectures} generates text: use task='generate'"
        )
    if task in ("score", "classify") and not classifier:
        raise ValueError(
            f"task={task!r} needs a sequence-classification checkpoint "
            "(BertForSequenceClassification, XLMRobertaForSequenceClassification, "
            f"Qwen3ForSequenceClassification); architecture {architectures} has no such head"
        )
    if task == "score" and num_labels != 1:
        raise ValueError(
            f"task='score' needs a classifier with one label (a relevance score), this one has "
            f"num_labels={num_labels}; use task='classify' for its label probabilities"
        )
    return task


def resolve_pooler_config(
    model_dir: str, architectures: list[str], override: PoolerConfig | None = None
) -> PoolerConfig:
    """The pooling of an embed model: override > sentence-transformers files > the model's
    default, field by field."""
    if override is not None and not isinstance(override, PoolerConfig):
        raise ValueError(
            f"override_pooler_config must be a PoolerConfig, got {type(override).__name__}"
        )
    resolved = default_pooler_config(architectures)
    if is_classifier_architecture(architectures):
        return resolved  # its head was trained on that row; no sentence-transformers pooling
    for layer in (load_sentence_transformers_pooler(model_dir), override):
        if layer is None:
            continue
        if layer.pooling_type is not None:
            resolved = replace(resolved, pooling_type=layer.pooling_type)
        if layer.normalize is not None:
            resolved = replace(resolved, normalize=layer.normalize)
    return resolved
