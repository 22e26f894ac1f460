"""A classifier's pooled rows to probabilities: its head's logits, then HF's activation.

Which activation turns logits into what a user reads follows the checkpoint, as transformers'
text-classification pipeline does: `problem_type` "multi_label_classification", or a single
label, gives an independent sigmoid per label (a cross-encoder's relevance in [0, 1]: what
sentence-transformers' CrossEncoder and vLLM's score report); "regression" keeps the raw value;
otherwise a softmax over the labels. Deciding it here, once per model, keeps `/v1/score`,
`/v1/rerank`, `/v1/classify` and the offline API agreeing on every number.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

SIGMOID, SOFTMAX, IDENTITY = "sigmoid", "softmax", "none"


def classifier_activation(hf_config: Any) -> str:
    """ "sigmoid", "softmax" or "none" (regression) for this checkpoint's head."""
    problem = getattr(hf_config, "problem_type", None)
    if problem == "regression":
        return IDENTITY
    if problem == "multi_label_classification" or int(getattr(hf_config, "num_labels", 2)) == 1:
        return SIGMOID
    return SOFTMAX


class ClassifierHead:
    """The model's `classify` (pooled hidden rows -> logits) followed by the activation."""

    def __init__(self, classify: Callable[[torch.Tensor], torch.Tensor], hf_config: Any) -> None:
        self.classify = classify
        self.activation = classifier_activation(hf_config)

    def __call__(self, pooled: torch.Tensor) -> torch.Tensor:
        """float32 `[num_seqs, num_labels]` probabilities (or raw values for a regression)."""
        logits = self.classify(pooled).float()
        if self.activation == SIGMOID:
            return torch.sigmoid(logits)
        if self.activation == SOFTMAX:
            return torch.softmax(logits, dim=-1)
        return logits
