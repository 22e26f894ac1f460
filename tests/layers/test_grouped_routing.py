"""DeepSeek routing in `select_experts` against transformers' DeepSeek-V2 and V3 routers.

Both HF routers return their k experts unsorted, so ids and weights are compared after sorting
by expert id. Router weights are large (std 0.3) and inputs many, so groups really differ
between tokens; a check that the group limit changes some choice guards the comparison.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tokenwise.layers.fused_moe import GroupedRouting, select_experts

H, E, K = 16, 8, 2


def _randn(*shape: int, seed: int, std: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * std


def _sorted(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids_sorted, order = ids.sort(dim=-1)
    return weights.gather(1, order).float(), ids_sorted


def _hf_router(version: int, top_k: int = K, **overrides: Any) -> Any:
    from transformers import AutoConfig

    model_type = f"deepseek_v{version}"
    kwargs = {"hidden_size": H, "num_attention_heads": 2, "n_routed_experts": E,
              "num_experts_per_tok": top_k, **overrides}  # fmt: skip
    config = AutoConfig.for_model(model_type, **kwargs)
    if version == 2:
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

        router = DeepseekV2TopkRouter(config)
    else:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

        router = DeepseekV3TopkRouter(config)
        router.e_score_correction_bias.copy_(_randn(E, seed=5, std=0.3))
    with torch.no_grad():
        router.weight.copy_(_randn(E, H, seed=2, std=0.3))
    return router


# name -> (HF config overrides, n_group, topk_group, top_k). With top-2 of the best 2 groups
# the group limit never changes a choice (the two best experts lie in the two best groups), so
# the grouped case routes each token to 3 experts.
V2_CASES = {
    "greedy": ({"topk_method": "greedy", "routed_scaling_factor": 1.0}, None, None, K),
    "greedy-scaled": ({"topk_method": "greedy", "routed_scaling_factor": 2.5}, None, None, K),
    "group-limited": (
        {
            "topk_method": "group_limited_greedy",
            "n_group": 4,
            "topk_group": 2,
            "routed_scaling_factor": 1.5,
        },
        4,
        2,
        3,
    ),  # fmt: skip
}


@pytest.mark.parametrize("case", list(V2_CASES))
def test_deepseek_v2_routing_equals_hf(case: str) -> None:
    overrides, groups, topk_group, top_k = V2_CASES[case]
    router = _hf_router(2, top_k, **overrides)
    x = _randn(64, H, seed=3)
    with torch.no_grad():
        _, hf_weights, hf_ids = router(x)
    routing = GroupedRouting(
        num_expert_group=groups,
        topk_group=topk_group,
        routed_scaling_factor=overrides["routed_scaling_factor"],
    )
    weights, ids = select_experts(F.linear(x, router.weight), top_k, False, routing)
    got, want = _sorted(weights, ids), _sorted(hf_weights, hf_ids)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-6)
    if groups is not None:  # the group limit decides some choices
        plain = select_experts(F.linear(x, router.weight), top_k, False)[1]
        assert not torch.equal(plain.sort().values, got[1])


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_deepseek_v3_routing_equals_hf(norm_topk_prob: bool) -> None:
    router = _hf_router(
        3, n_group=4, topk_group=2, norm_topk_prob=norm_topk_prob, routed_scaling_factor=2.5
    )
    x = _randn(64, H, seed=4)
    with torch.no_grad():
        _, hf_weights, hf_ids = router(x)
    routing = GroupedRouting(
        scoring_func="sigmoid",
        num_expert_group=4,
        topk_group=2,
        e_score_correction_bias=router.e_score_correction_bias,
        routed_scaling_factor=2.5,
    )
    weights, ids = select_experts(F.linear(x, router.weight), K, norm_topk_prob, routing)
    got, want = _sorted(weights, ids), _sorted(hf_weights, hf_ids)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-6)
    # The bias and the group limit each decide some choices (else the test would not see them).
    unbiased = select_experts(F.linear(x, router.weight), K, norm_topk_prob,
                              GroupedRouting("sigmoid", 4, 2))[1]  # fmt: skip
    ungrouped = select_experts(F.linear(x, router.weight), K, norm_topk_prob,
                               GroupedRouting("sigmoid", e_score_correction_bias=
                                              router.e_score_correction_bias))[1]  # fmt: skip
    assert not torch.equal(unbiased.sort().values, got[1])
    assert not torch.equal(ungrouped.sort().values, got[1])


@pytest.mark.parametrize(
    ("routing", "top_k", "match"),
    [
        (GroupedRouting(scoring_func="tanh"), 2, "scoring_func"),
        (GroupedRouting(num_expert_group=3, topk_group=1), 2, "n_group"),
        (GroupedRouting(num_expert_group=4, topk_group=5), 2, "topk_group"),
        (GroupedRouting(num_expert_group=4, topk_group=None), 2, "topk_group"),
        (GroupedRouting(num_expert_group=4, topk_group=1), 3, "top_k"),
    ],
)
def test_bad_routing_settings_are_named(routing: GroupedRouting, top_k: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        routing.check(E, top_k)
