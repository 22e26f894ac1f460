"""Guided decoding across data-parallel ranks: the spec crosses the process boundary as a plain
dataclass, each rank compiles it for itself, and a bad spec is refused in the caller before a
rank is chosen."""

from __future__ import annotations

import re

import pytest

from tokenwise import LLM, GuidedDecodingParams, SamplingParams

PATTERN = r"(yes|no)-[0-9]{2}"


def test_guided_requests_on_two_ranks() -> None:
    llm = LLM(dtype="float32", device="cpu", data_parallel_size=2, num_gpu_blocks=128)
    try:
        with pytest.raises(ValueError, match="guided_decoding.regex: invalid regex"):
            llm.generate("x", SamplingParams(guided_decoding=GuidedDecodingParams(regex="(a")))
        params = [
            SamplingParams(temperature=1.0, seed=i, max_tokens=16,
                           guided_decoding=GuidedDecodingParams(regex=PATTERN))
            for i in range(8)
        ]  # fmt: skip
        outs = llm.generate(["def f(x):"] * 8, params, use_tqdm=False)
        assert all(re.fullmatch(PATTERN, o.outputs[0].text) for o in outs)
        per_rank = [s.generation_tokens_total for s in llm.llm_engine.get_rank_stats()]
        assert all(n > 0 for n in per_rank), per_rank  # both ranks served guided requests
    finally:
        llm.shutdown()
