"""Micro-batches: cutting one step's token stream into pieces that run one after another.

Splitting a batch in two lets the communication of one micro-batch (e.g. the MoE all-to-all)
overlap the compute of the other. The cut is made in token space, not request space, so the two
halves are balanced even when one long prefill dominates the batch; the price is that a request
can straddle the cut, and its attention must then see a consistent (shorter) sequence in the
first half. Everything here is pure bookkeeping on Python ints so it is cheap and testable.
"""

from __future__ import annotations

import bisect
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import accumulate, pairwise

import torch

from tokenwise.config import ParallelConfig

__all__ = [
    "UBatchSlice",
    "check_ubatch_thresholds",
    "create_ubatch_slices",
    "pad_ubatch_slices",
    "split_request_lengths",
]


@dataclass(frozen=True)
class UBatchSlice:
    """Which requests and which tokens (offsets in the batch's token stream) one micro-batch has.

    `request_slice` may overlap the neighbouring slice's by one request: that request is the one
    cut by the boundary, and each side runs its own part of the request's query tokens.
    """

    request_slice: slice
    token_slice: slice

    def is_empty(self) -> bool:
        return self.token_slice.stop <= self.token_slice.start

    @property
    def num_tokens(self) -> int:
        return max(0, self.token_slice.stop - self.token_slice.start)

    @property
    def num_requests(self) -> int:
        return max(0, self.request_slice.stop - self.request_slice.start)


def check_ubatch_thresholds(
    parallel_config: ParallelConfig, num_tokens: int, uniform_decode: bool | None
) -> bool:
    """Is this batch big enough that splitting it pays for the extra kernel launches?

    Decode batches are cheap per token, so they get their own (lower) threshold. An unknown
    batch kind (`None`) is judged as a prefill: the conservative choice.
    """
    if not parallel_config.enable_microbatching:
        return False
    if uniform_decode:
        return num_tokens >= parallel_config.microbatching_decode_token_threshold
    return num_tokens >= parallel_config.microbatching_prefill_token_threshold


def _cumulative(num_scheduled_tokens: Sequence[int]) -> list[int]:
    counts = [int(n) for n in num_scheduled_tokens]
    for i, n in enumerate(counts):
        if n < 1:
            raise ValueError(f"request {i} has {n} scheduled tokens; each request needs >= 1")
    return [0, *accumulate(counts)]


def _slice_for_tokens(cu: list[int], start: int, stop: int) -> UBatchSlice:
    num_reqs = len(cu) - 1
    if start == stop:
        # No tokens, no requests; the position only keeps slices ordered.
        first = min(bisect.bisect_left(cu, start), num_reqs)
        return UBatchSlice(slice(first, first), slice(start, stop))
    first = bisect.bisect_right(cu, start) - 1  # request holding token `start`
    last = bisect.bisect_right(cu, stop - 1) - 1  # request holding token `stop - 1`
    return UBatchSlice(slice(first, last + 1), slice(start, stop))


def create_ubatch_slices(
    num_scheduled_tokens: Sequence[int], split_point: int | Sequence[int]
) -> list[UBatchSlice]:
    """Cut the concatenated token stream at `split_point` (one offset or several).

    Returns len(split points) + 1 slices whose token slices are contiguous and cover every token
    exactly once. A split point on a request boundary shares no request; one inside a request
    puts that request in both neighbours. A split point at 0 or at the total gives an empty
    slice (check `is_empty()`), which callers normally treat as "do not micro-batch".
    """
    cu = _cumulative(num_scheduled_tokens)
    total = cu[-1]
    if isinstance(split_point, numbers.Integral):
        points = [int(split_point)]
    else:
        points = [int(p) for p in split_point]
    if not points:
        raise ValueError("create_ubatch_slices needs at least one split point")
    bounds = [0, *points, total]
    for lo, hi in pairwise(bounds):
        if not 0 <= lo <= hi <= total:
            raise ValueError(
                f"split points must be non-decreasing and within [0, {total}] "
                f"(the batch's token count), got {points}"
            )
    return [_slice_for_tokens(cu, lo, hi) for lo, hi in pairwise(bounds)]


def pad_ubatch_slices(
    slices: Sequence[UBatchSlice],
    num_total_tokens_padded: int,
    num_reqs_padded: int | None = None,
) -> list[UBatchSlice]:
    """Extend the last slice so the slices cover a padded batch.

    When a step is padded (to a captured graph size, or to the largest DP rank), the padding
    tokens sit at the end of the token stream, so they belong to the last micro-batch; padding
    requests, if any, likewise. The input is not modified.
    """
    if not slices:
        raise ValueError("pad_ubatch_slices needs at least one slice")
    last = slices[-1]
    if num_total_tokens_padded < last.token_slice.stop:
        raise ValueError(
            f"num_total_tokens_padded={num_total_tokens_padded} is smaller than the "
            f"{last.token_slice.stop} tokens the slices already cover"
        )
    req_stop = last.request_slice.stop if num_reqs_padded is None else num_reqs_padded
    if req_stop < last.request_slice.stop:
        raise ValueError(
            f"num_reqs_padded={num_reqs_padded} is smaller than the "
            f"{last.request_slice.stop} requests the slices already cover"
        )
    padded = replace(
        last,
        request_slice=slice(last.request_slice.start, req_stop),
        token_slice=slice(last.token_slice.start, num_total_tokens_padded),
    )
    return [*slices[:-1], padded]


def _as_ints(values: Sequence[int] | torch.Tensor) -> list[int]:
    return [int(x) for x in (values.tolist() if isinstance(values, torch.Tensor) else values)]


def split_request_lengths(
    query_start_loc: Sequence[int] | torch.Tensor,
    seq_lens: Sequence[int] | torch.Tensor,
    ubatch: UBatchSlice,
) -> tuple[list[int] | torch.Tensor, list[int] | torch.Tensor]:
    """Per-slice `query_start_loc` (re-based to 0) and `seq_lens` of the slice's requests.

    A request's query tokens are the last tokens of its sequence, so the part of a split request
    that runs first must not see the tokens that run later: its sequence ends where its part of
    the query ends, i.e. its seq len shrinks by the query tokens that fall after the slice. The
    part that runs last keeps the full seq len. Positions computed from these lengths therefore
    agree with the unsplit batch. Tensors in give tensors (same dtype) out; sequences give lists.
    """
    qsl = _as_ints(query_start_loc)
    lens = _as_ints(seq_lens)
    num_reqs = len(qsl) - 1
    if num_reqs < 0 or len(lens) != num_reqs:
        raise ValueError(
            f"query_start_loc must have num_reqs + 1 entries and seq_lens num_reqs; got "
            f"{len(qsl)} and {len(lens)}"
        )
    r0, r1 = ubatch.request_slice.start, ubatch.request_slice.stop
    t0, t1 = ubatch.token_slice.start, ubatch.token_slice.stop
    if not (0 <= r0 <= r1 <= num_reqs and 0 <= t0 <= t1 <= qsl[-1]):
        raise ValueError(
            f"{ubatch} reaches beyond the batch ({num_reqs} requests, {qsl[-1]} tokens); for a "
            "padded slice pass the padded query_start_loc and seq_lens"
        )
    out_qsl, out_lens = [0], []
    for i in range(r0, r1):
        q_start, q_end = max(qsl[i], t0), min(qsl[i + 1], t1)
        if q_end <= q_start:
            raise ValueError(f"request {i} has no tokens in {ubatch}")
        if lens[i] < qsl[i + 1] - qsl[i]:
            raise ValueError(
                f"request {i}: seq len {lens[i]} is shorter than its query "
                f"({qsl[i + 1] - qsl[i]} tokens)"
            )
        out_qsl.append(out_qsl[-1] + q_end - q_start)
        out_lens.append(lens[i] - (qsl[i + 1] - q_end))
    if out_qsl[-1] != t1 - t0:
        raise ValueError(
            f"{ubatch}: its requests hold {out_qsl[-1]} of its {t1 - t0} tokens; the request "
            "slice does not match the token slice"
        )
    qsl_out: list[int] | torch.Tensor = out_qsl
    lens_out: list[int] | torch.Tensor = out_lens
    if isinstance(query_start_loc, torch.Tensor):
        qsl_out = torch.tensor(out_qsl, dtype=query_start_loc.dtype, device=query_start_loc.device)
    if isinstance(seq_lens, torch.Tensor):
        lens_out = torch.tensor(out_lens, dtype=seq_lens.dtype, device=seq_lens.device)
    return qsl_out, lens_out
