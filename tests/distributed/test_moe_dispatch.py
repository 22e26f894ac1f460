"""The MoE layer's DP dispatch/combine over two real gloo ranks.

Each rank's "experts" are a rank-specific linear map (a stand-in for its shard of the experts);
the combined output on every rank must be the sum of both ranks' maps applied to its own
tokens, whatever the token counts, and chunking must bound how many rows one exchange moves.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from tests.distributed import _moe_dispatch_worker as worker
from tests.distributed._spawn import run_ranks
from tokenwise.distributed.moe_dispatch import DEFAULT_MOE_DP_CHUNK_SIZE, moe_dp_chunk_size

DEADLINE_S = 60.0


def _run_two_ranks() -> dict[int, dict[Any, Any]]:
    return run_ranks(worker.run_rank, 2, deadline_s=DEADLINE_S)


def test_dispatch_combine_sums_every_ranks_partials_for_own_tokens() -> None:
    got = _run_two_ranks()
    for n0, n1, chunk in worker.CASES:
        rounds = math.ceil(max(n0, n1) / chunk)
        for rank in range(2):
            entry = got[rank][(n0, n1, chunk)]
            assert entry["err"] < 1e-5, (rank, n0, n1, chunk, entry)
            # Both ranks run the same number of exchanges (set by the larger rank) ...
            assert len(entry["gathered_rows"]) == rounds
            # ... each moving at most one chunk per rank; a rank out of tokens sends 1 row.
            for idx, rows in enumerate(entry["gathered_rows"]):
                per_rank = [max(1, min(chunk, n - idx * chunk)) for n in (n0, n1)]
                assert rows == sum(per_rank)


def test_chunk_size_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TOKENWISE_MOE_DP_CHUNK_SIZE", raising=False)
    assert moe_dp_chunk_size() == DEFAULT_MOE_DP_CHUNK_SIZE
    monkeypatch.setenv("TOKENWISE_MOE_DP_CHUNK_SIZE", "7")
    assert moe_dp_chunk_size() == 7
    for bad in ("0", "-3", "many"):
        monkeypatch.setenv("TOKENWISE_MOE_DP_CHUNK_SIZE", bad)
        with pytest.raises(ValueError, match="TOKENWISE_MOE_DP_CHUNK_SIZE must be a positive"):
            moe_dp_chunk_size()
