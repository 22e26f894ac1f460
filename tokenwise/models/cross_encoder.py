"""BERT and XLM-RoBERTa sequence classifiers: cross-encoders for reranking and classification.

A cross-encoder reads a (query, document) pair as one sequence, `[CLS] query [SEP] document
[SEP]` with token type 1 on the document (BERT; XLM-RoBERTa has a single type), and its head
turns the [CLS] position's last hidden state into one logit per label: the relevance of the pair
when there is one label. The encoder is the embedding model's (`bert.py`), unchanged and still
token-wise; picking the [CLS] row of each sequence is the engine's pooler's job (CLS pooling,
no normalisation), and `classify` maps those pooled rows to logits. Dropout is inference's
identity, so it does not appear.

The heads differ only in names and in where the tanh projection lives: BERT's is the encoder's
`pooler.dense` (next to `bert.`) followed by `classifier`; XLM-RoBERTa's is inside the head,
`classifier.dense` then `classifier.out_proj`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenwise.config import EngineConfig, PoolerConfig
from tokenwise.models.bert import BertEmbeddingModel, XLMRobertaEmbeddingModel


def num_labels(hf_config: Any) -> int:
    """The classifier's output size, as HF counts it (`id2label` decides `num_labels`)."""
    return int(getattr(hf_config, "num_labels", 2))


class _TanhDense(nn.Module):
    """`dense` then tanh: BERT's pooler, and the first half of RoBERTa's head."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(x))


class BertForSequenceClassification(BertEmbeddingModel):
    is_classifier = True
    default_pooler_config = PoolerConfig(pooling_type="CLS", normalize=False)
    ignored_prefixes = ("cls.",)

    def __init__(self, config: EngineConfig, prefix: str = "") -> None:
        super().__init__(config, prefix)
        hf = config.model.hf_config
        self.pooler = _TanhDense(hf.hidden_size)
        self.classifier = nn.Linear(hf.hidden_size, num_labels(hf))

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """float32 logits `[num_seqs, num_labels]` of each sequence's [CLS] hidden state."""
        weight = self.classifier.weight
        return self.classifier(self.pooler(pooled.to(weight.dtype))).float()


class _RobertaHead(nn.Module):
    def __init__(self, hidden_size: int, labels: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.out_proj = nn.Linear(hidden_size, labels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(x)))


class XLMRobertaForSequenceClassification(XLMRobertaEmbeddingModel):
    is_classifier = True
    default_pooler_config = PoolerConfig(pooling_type="CLS", normalize=False)
    ignored_prefixes = ("lm_head.",)

    def __init__(self, config: EngineConfig, prefix: str = "") -> None:
        super().__init__(config, prefix)
        hf = config.model.hf_config
        self.classifier = _RobertaHead(hf.hidden_size, num_labels(hf))

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """float32 logits `[num_seqs, num_labels]` of each sequence's <s> hidden state."""
        return self.classifier(pooled.to(self.classifier.dense.weight.dtype)).float()
