"""The engine's EAGLE drafts equal a plain-torch reference proposer's, token for token.

Parity with HF only shows that verification is exact; acceptance with a copying head only that
tokens line up. This compares every proposal the engine makes (paged head K/V addressed by the
target's blocks, catch-up from where the head's cache stops being right, the rollback of fed
drafts, look-ahead in scratch blocks, batched and split passes) with `ReferenceHead`, which
recomputes the head from position 0 with transformers' features each time. Prompts sharing a
prefix are left out: a prefix-cache hit gives the head no features for the cached positions,
so its K/V there is only as right as what another request wrote (by design, see
`tokenwise.spec_decode.eagle`).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.engine._fixtures import hf_model, mixed_prompts
from tests.spec_decode.eagle_reference import ReferenceHead
from tests.spec_decode.test_eagle import (
    _hf_features,
    generate,
    hf_refs,
    make_llm,
    random_head,
    target,
)


def _distinct_prompts() -> list[list[int]]:
    """`mixed_prompts` without prompts that share their first token with an earlier one."""
    seen: set[int] = set()
    kept = []
    for p in mixed_prompts():
        if p[0] not in seen:
            seen.add(p[0])
            kept.append(p)
    return kept


@pytest.mark.parametrize(
    "config",
    [{"block_size": 4}, {"block_size": 4, "max_num_batched_tokens": 8, "max_num_seqs": 3}],
    ids=["block-4", "block-4-chunked-8-seqs-3"],
)
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_engine_drafts_equal_the_reference(method: str, config: dict[str, Any]) -> None:
    path, head = target(method), random_head(method)
    llm = make_llm(path, method, head, k=6, **config)
    proposer = llm.llm_engine.drafter.draft_model
    proposals: list[tuple[list[int], list[int]]] = []
    propose_batch = proposer.propose_batch

    def spy(requests: list[Any]) -> list[list[int]]:
        drafts = propose_batch(requests)
        proposals.extend((r.token_ids.tolist(), d) for r, d in zip(requests, drafts, strict=True))
        return drafts

    proposer.propose_batch = spy
    prompts = _distinct_prompts()
    outputs = generate(llm, prompts)
    refs = hf_refs(path)
    assert outputs == [refs[mixed_prompts().index(p)] for p in prompts]
    ref = ReferenceHead(head, method, hf_model(path))
    full = [p + o for p, o in zip(prompts, outputs, strict=True)]
    rows = [ref.target_rows(_hf_features(path, method, seq)) for seq in full]
    assert len(proposals) > len(prompts)
    for tokens, drafts in proposals:
        owner = next(i for i, seq in enumerate(full) if seq[: len(tokens)] == tokens)
        assert drafts == ref.propose(tokens, rows[owner], len(drafts)), len(tokens)
