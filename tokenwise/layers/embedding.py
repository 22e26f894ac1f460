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
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenwise.distributed.tp_state import get_tp_rank, get_tp_size, tp_all_gather, tp_all_reduce
from tokenwise.layers.quantization.base_config import LinearMethodBase
from tokenwise.layers.quantization.unquantized import UNQUANTIZED
from tokenwise.layers.weight_utils import (
    CheckpointTensor,
    check_full_shape,
    copy_checked,
    default_weight_loader,
)
from tokenwise.native import fused as cpu_fused


def vocab_range(num_embeddings: int, tp_rank: int, tp_size: int) -> tuple[int, int, int]:
    """(first id, end id, rows per rank) of rank `tp_rank`'s slice of the vocabulary.

    Every rank holds `ceil(vocab / tp)` rows; the last rank(s) fewer real ones (the rest is
    zero padding), so the all-gathered logits are `tp * rows` wide and trimmed to the vocab.
    """
    per_rank = -(-num_embeddings // tp_size)
    start = min(tp_rank * per_rank, num_embeddings)
    return start, min(start + per_rank, num_embeddings), per_rank


def vocab_weight_loader(num_embeddings: int, tp_rank: int, tp_size: int) -> Callable[..., None]:
    """A loader copying rank `tp_rank`'s rows of a full `[vocab, dim]` checkpoint tensor."""

    def load(param: torch.Tensor, loaded: CheckpointTensor, shard_id: object = None) -> None:
        if shard_id is not None:
            raise ValueError(f"this parameter is not fused; got shard id {shard_id!r}")
        if tp_size == 1:
            default_weight_loader(param, loaded)
            return
        check_full_shape(loaded, (num_embeddings, *param.shape[1:]))
        start, end, _ = vocab_range(num_embeddings, tp_rank, tp_size)
        with torch.no_grad():
            param[end - start :].zero_()  # padding rows (past the vocabulary) stay zero
        copy_checked(param.data.narrow(0, 0, end - start), loaded.narrow(0, start, end - start))

    return load


class VocabParallelEmbedding(nn.Module):
    """Token embedding; under TP each rank holds a contiguous, padded range of vocab rows."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.vocab_start, self.vocab_end, rows = vocab_range(
            num_embeddings, self.tp_rank, self.tp_size
        )
        self.num_embeddings_per_partition = rows
        self.weight = nn.Parameter(torch.empty(rows, embedding_dim), requires_grad=False)
        self.weight.weight_loader = vocab_weight_loader(num_embeddings, self.tp_rank, self.tp_size)
        # A quantized table (`layers.quantization`): rows are dequantized as they are looked up.
        self.quant_table: Any = None

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant_table is not None:
            return self.quant_table.rows(ids, self.weight.dtype)
        out = cpu_fused.embedding_rows(ids, self.weight)  # a decode step's few ids: row copies
        return F.embedding(ids, self.weight) if out is None else out

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._lookup(input_ids)
        # Ids of other ranks look up row 0 and are zeroed; the all-reduce fills them in.
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        out = self._lookup(torch.where(mine, input_ids - self.vocab_start, 0))
        return tp_all_reduce(out.masked_fill_(~mine.unsqueeze(-1), 0))

    def extra_repr(self) -> str:
        shard = f", rows={self.vocab_start}..{self.vocab_end}" if self.tp_size > 1 else ""
        return f"{self.num_embeddings}, {self.embedding_dim}{shard}"


class ParallelLMHead(nn.Module):
    """Projects hidden states to vocabulary logits; `tie_to` reuses an embedding's weight.

    With tying the head registers the *same* Parameter object, so `named_parameters()` lists it
    once (under the embedding) and the loader never expects an `lm_head.weight` tensor. Under
    TP each rank computes the logits of its vocab rows; they are all-gathered (float32) and the
    padding columns dropped, so every rank returns the full `[tokens, vocab]` logits.
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
        # A linear layer's method (`layers.linear`): dense, or quantized after loading.
        self.quant_method: LinearMethodBase = UNQUANTIZED
        self.quant_weight: Any = None
        self.packed_weight: torch.Tensor | None = None  # set by cpu_prepack on CPU
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.vocab_start, self.vocab_end, rows = vocab_range(
            num_embeddings, self.tp_rank, self.tp_size
        )
        if tie_to is not None:
            if tie_to.num_embeddings != num_embeddings or tie_to.embedding_dim != embedding_dim:
                raise ValueError(
                    f"cannot tie an LM head of {(num_embeddings, embedding_dim)} to an "
                    f"embedding of {(tie_to.num_embeddings, tie_to.embedding_dim)}"
                )
            if (tie_to.tp_rank, tie_to.tp_size) != (self.tp_rank, self.tp_size):
                raise ValueError("a tied LM head must be built under the embedding's TP group")
            self.weight = tie_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(rows, embedding_dim), requires_grad=False)
            self.weight.weight_loader = vocab_weight_loader(
                num_embeddings, self.tp_rank, self.tp_size
            )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.quant_method.apply(self, hidden_states, None).float()
        if self.tp_size == 1:
            return logits
        return tp_all_gather(logits, dim=-1)[..., : self.num_embeddings]

    def extra_repr(self) -> str:
        return f"{self.embedding_dim} -> {self.num_embeddings}, tied={self.tied}"
