"""Turn a batch of next-token logits into token ids, vectorised over rows.

Every stage works on the whole [B, V] tensor at once with per-row parameter
tensors; the only Python loop is over seeded rows, because each of those must
draw its noise from its own generator to stay reproducible across batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tokenwise.native import fused as cpu_fused
from tokenwise.sampling.metadata import SamplingMetadata
from tokenwise.sampling.params import _SAMPLING_EPS, SamplingParams


@dataclass
class LogprobsTensors:
    """Column 0 is the sampled token; columns 1..N are the top-N by logprob."""

    token_ids: torch.Tensor  # [B, N+1] int64
    logprobs: torch.Tensor  # [B, N+1] float32
    ranks: torch.Tensor  # [B] int64, rank of the sampled token (1 = most likely)


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: LogprobsTensors | None


class Sampler(nn.Module):
    """Penalties -> greedy | (temperature -> min-p -> top-k/top-p -> random draw)."""

    @staticmethod
    def is_plain_greedy(params: list[SamplingParams]) -> bool:
        """Whether every row only takes its argmax: greedy, no logprobs, no penalties. Such a
        step needs no `SamplingMetadata` (a handful of tensors built per step) at all."""
        return all(
            p.temperature < _SAMPLING_EPS
            and p.logprobs is None
            and p.presence_penalty == 0.0
            and p.frequency_penalty == 0.0
            and p.repetition_penalty == 1.0
            for p in params
        )

    @staticmethod
    def greedy(logits: torch.Tensor) -> SamplerOutput:
        """What `forward` returns for plain-greedy rows (`is_plain_greedy`): each row's argmax."""
        return SamplerOutput(sampled_token_ids=_argmax(logits.float()), logprobs=None)

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()
        # Logprobs describe the model's own distribution, as vLLM reports by
        # default, so they are taken before any request-specific reshaping.
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)

        if not metadata.no_penalties:
            logits = apply_penalties(logits, metadata)

        greedy = None if metadata.all_random else _argmax(logits)
        if metadata.all_greedy:
            assert greedy is not None
            sampled = greedy
        else:
            random = self._sample_random(logits, metadata)
            sampled = (
                random if greedy is None else torch.where(metadata.greedy_mask, greedy, random)
            )

        out_logprobs = None
        if raw_logprobs is not None:
            assert metadata.max_num_logprobs is not None
            out_logprobs = gather_logprobs(raw_logprobs, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=out_logprobs)

    @staticmethod
    def _sample_random(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        return exponential_race(sampling_probs(logits, metadata), metadata.generators)


def sampling_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Each row's distribution for a random draw: temperature -> min-p -> top-k/top-p ->
    softmax (penalties, when any, are applied to `logits` before). Speculative verification
    (`rejection.verify`) tests drafts against exactly this distribution."""
    logits = logits / metadata.temperature.unsqueeze(1)
    if metadata.min_p is not None:
        logits = apply_min_p(logits, metadata.min_p)
    if metadata.top_k is not None or metadata.top_p is not None:
        logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
    return torch.softmax(logits, dim=-1)


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (first index on ties), as torch's, faster on CPU."""
    return cpu_fused.argmax(logits)


def exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Draw one token per row: argmax(p / E) with E ~ Exp(1) picks i with probability p_i.

    This avoids torch.multinomial's per-row CPU-GPU syncs and lets seeded rows
    swap in their own noise row-by-row without touching anyone else's.
    """
    q = torch.empty_like(probs).exponential_()
    for row, gen in generators.items():
        if gen.device == probs.device:
            q[row].exponential_(generator=gen)
        else:  # a request's CPU generator with GPU logits: draw where the generator lives
            noise = torch.empty(probs.shape[1], device=gen.device, dtype=probs.dtype)
            q[row].copy_(noise.exponential_(generator=gen))
    return (probs / q).argmax(dim=-1)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens less likely than ``min_p`` times the row's most likely token."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask tokens outside each row's top-k and outside its top-p nucleus, with one sort.

    The nucleus is the smallest prefix of the sorted distribution whose mass
    reaches top_p; a token is dropped when the mass strictly before it already
    does, so the most likely token always survives.
    """
    vocab = logits.shape[-1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    positions = torch.arange(vocab, device=logits.device).unsqueeze(0)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        drop = positions >= top_k.clamp(min=1).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    if top_p is not None:
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # top_p == 1 means off: rounding in cumsum must not trim the tail then.
        beyond = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
        drop = drop | beyond
    drop_in_vocab_order = torch.empty_like(drop).scatter_(1, sorted_idx, drop)
    return logits.masked_fill(drop_in_vocab_order, float("-inf"))


def _token_counts(token_ids: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[B, V] occurrence counts, from one padded tensor and one scatter_add."""
    width = max((len(row) for row in token_ids), default=0)
    counts = torch.zeros((len(token_ids), vocab + 1), dtype=torch.int64, device=device)
    if width == 0:
        return counts[:, :vocab]
    # Pad with an extra bucket (index vocab) that is sliced away afterwards.
    padded = [row + [vocab] * (width - len(row)) for row in token_ids]
    index = torch.tensor(padded, dtype=torch.int64, device=device)
    counts.scatter_add_(1, index, torch.ones_like(index))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Apply repetition (prompt + output) and presence/frequency (output only) penalties.

    Repetition follows HF/vLLM: a seen token's logit is divided by the penalty
    when positive and multiplied when negative, so a penalty > 1 always makes
    it less likely. Presence/frequency follow the OpenAI API: subtract a flat
    amount once seen, and an amount proportional to how often it was generated.
    """
    vocab = logits.shape[-1]
    output_counts = _token_counts(metadata.output_token_ids, vocab, logits.device)
    if metadata.repetition_penalties is not None:
        seen = output_counts > 0
        if metadata.prompt_token_ids is not None:
            seen = seen | (_token_counts(metadata.prompt_token_ids, vocab, logits.device) > 0)
        penalty = metadata.repetition_penalties.unsqueeze(1)
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalised, logits)
    if metadata.frequency_penalties is not None:
        logits = logits - metadata.frequency_penalties.unsqueeze(1) * output_counts.float()
    if metadata.presence_penalties is not None:
        logits = logits - metadata.presence_penalties.unsqueeze(1) * (output_counts > 0).float()
    return logits


def gather_logprobs(logprobs: torch.Tensor, sampled: torch.Tensor, num: int) -> LogprobsTensors:
    """Pack the sampled token's logprob and rank with the row's top-``num`` alternatives."""
    sampled_col = sampled.unsqueeze(1)
    sampled_lp = logprobs.gather(1, sampled_col)
    # Rank = 1 + number of tokens strictly more likely than the sampled one.
    ranks = (logprobs > sampled_lp).sum(dim=-1) + 1
    top_lp, top_ids = logprobs.topk(num, dim=-1)
    return LogprobsTensors(
        token_ids=torch.cat([sampled_col, top_ids], dim=1),
        logprobs=torch.cat([sampled_lp, top_lp], dim=1),
        ranks=ranks,
    )
