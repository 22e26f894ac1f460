"""Token embedding and the LM head that can share its weight.

The LM head is a separate module (rather than a bare `nn.Linear`) so that tying is explicit and
`compute_logits` always returns float32: the sampler works in fp32 whatever the model dtype.

Under tensor parallelism both split the vocabulary into contiguous ranges, one per rank, each
padded to ceil(vocab / tp) rows: the embedding looks up only its own ids (others give zeros)
and all-reduces; the head computes its own columns of the logits, which are all-gathered (and
the padding dropped) before sampling.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tokenwise.distributed.tp_state import get_tp_rank, get_tp_size, tp_all_gather, tp_all_reduce
from tokenwise.layers.weight_utils import copy_checked, default_weight_loader


def vocab_range(num_embeddings: int) -> tuple[int, int, int]:
    """(first id, end id, rows per rank) of this rank's slice of the vocabulary."""
    per_rank = -(-num_embeddings // get_tp_size())
    start = min(get_tp_rank() * per_rank, num_embeddings)
    return start, min(start + per_rank, num_embeddings), per_rank


def vocab_weight_loader(num_embeddings: int) -> Callable[..., None]:
    """A loader copying this rank's rows of a full `[vocab, dim]` checkpoint tensor."""

    def load(param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
        if shard_id is not None:
            raise ValueError(f"this parameter is not fused; got shard id {shard_id!r}")
        if get_tp_size() == 1 or loaded.shape[0] != num_embeddings:
            default_weight_loader(param, loaded)  # also names a shape mismatch
            return
        start, end, _ = vocab_range(num_embeddings)
        with torch.no_grad():
            param.zero_()  # padding rows (past the vocabulary) stay zero
        copy_checked(param.data.narrow(0, 0, end - start), loaded.narrow(0, start, end - start))

    return load


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.vocab_start, self.vocab_end, rows = vocab_range(num_embeddings)
        self.weight = nn.Parameter(torch.empty(rows, embedding_dim), requires_grad=False)
        self.weight.weight_loader = vocab_weight_loader(num_embeddings)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if get_tp_size() == 1:
            return F.embedding(input_ids, self.weight)
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(mine, input_ids - self.vocab_start, 0)
        out = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return tp_all_reduce(out)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class ParallelLMHead(nn.Module):
    """Projects hidden states to vocabulary logits; `tie_to` reuses an embedding's weight.

    With tying the head registers the *same* Parameter object, so `named_parameters()` lists it
    once (under the embedding) and the loader never expects an `lm_head.weight` tensor.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        tie_to: VocabParallelEmbedding | None = None,
    ) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tied = tie_to is not None
        _, _, rows = vocab_range(num_embeddings)
        if tie_to is not None:
            if tie_to.num_embeddings != num_embeddings or tie_to.embedding_dim != embedding_dim:
                raise ValueError(
                    f"cannot tie an LM head of {(num_embeddings, embedding_dim)} to an "
                    f"embedding of {(tie_to.num_embeddings, tie_to.embedding_dim)}"
                )
            self.weight = tie_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(rows, embedding_dim), requires_grad=False)
            self.weight.weight_loader = vocab_weight_loader(num_embeddings)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden_states, self.weight).float()
        if get_tp_size() == 1:
            return logits
        return tp_all_gather(logits, dim=-1)[..., : self.num_embeddings]

    def extra_repr(self) -> str:
        return f"{self.embedding_dim} -> {self.num_embeddings}, tied={self.tied}"
