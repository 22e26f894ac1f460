"""Token embedding and the LM head that can share its weight.

The LM head is a separate module (rather than a bare `nn.Linear`) so that tying is explicit and
`compute_logits` always returns float32: the sampler works in fp32 whatever the model dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenwise.layers.weight_utils import default_weight_loader


class VocabEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class LMHead(nn.Module):
    """Projects hidden states to vocabulary logits; `tie_to` reuses an embedding's weight.

    With tying the head registers the *same* Parameter object, so `named_parameters()` lists it
    once (under the embedding) and the loader never expects an `lm_head.weight` tensor.
    """

    def __init__(
        self, num_embeddings: int, embedding_dim: int, tie_to: VocabEmbedding | None = None
    ) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tied = tie_to is not None
        if tie_to is not None:
            if tie_to.weight.shape != (num_embeddings, embedding_dim):
                raise ValueError(
                    f"cannot tie an LM head of {(num_embeddings, embedding_dim)} to an "
                    f"embedding of {tuple(tie_to.weight.shape)}"
                )
            self.weight = tie_to.weight
        else:
            self.weight = nn.Parameter(
                torch.empty(num_embeddings, embedding_dim), requires_grad=False
            )
            self.weight.weight_loader = default_weight_loader

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden_states, self.weight).float()

    def extra_repr(self) -> str:
        return f"{self.embedding_dim} -> {self.num_embeddings}, tied={self.tied}"
