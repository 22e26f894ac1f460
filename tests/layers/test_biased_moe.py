"""`BiasedFusedMoE` (gpt-oss's experts) against a per-token reference written from transformers'
`GptOssExperts`: checkpoint layout (`x @ W`, gate/up interleaved) in, biases, clamped SwiGLU,
softmax over the top-k logits. Eager and through the `moe_experts` op (what compiled code
calls), and one intermediate slice of two adding up to the whole (TP / DP sharding)."""

from __future__ import annotations

import pytest
import torch

from tokenwise.config import EngineConfig, ParallelConfig
from tokenwise.layers.fused_moe.biased import BiasedFusedMoE

E, K, H, INTER, ALPHA, LIMIT = 4, 2, 32, 64, 1.702, 1.5


def _checkpoint(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "gate_up_proj": torch.randn(E, H, 2 * INTER, generator=g) * 0.3,
        "gate_up_proj_bias": torch.randn(E, 2 * INTER, generator=g),
        "down_proj": torch.randn(E, INTER, H, generator=g) * 0.3,
        "down_proj_bias": torch.randn(E, H, generator=g),
    }


def _reference(
    x: torch.Tensor, logits: torch.Tensor, ckpt: dict[str, torch.Tensor]
) -> torch.Tensor:
    top, ids = torch.topk(logits, K, dim=-1)
    weights = torch.softmax(top, dim=-1)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(K):
            e = int(ids[t, j])
            gate_up = x[t] @ ckpt["gate_up_proj"][e] + ckpt["gate_up_proj_bias"][e]
            gate, up = gate_up[0::2].clamp(max=LIMIT), gate_up[1::2].clamp(-LIMIT, LIMIT)
            h = (up + 1) * gate * torch.sigmoid(gate * ALPHA)
            out[t] += weights[t, j] * (h @ ckpt["down_proj"][e] + ckpt["down_proj_bias"][e])
    return out


def _layer(parallel: ParallelConfig | None = None) -> BiasedFusedMoE:
    config = EngineConfig(parallel=parallel or ParallelConfig())
    layer = BiasedFusedMoE(E, K, H, INTER, config, swiglu_alpha=ALPHA, swiglu_limit=LIMIT)
    for name, tensor in _checkpoint().items():
        layer.load_stacked(name, tensor)
    return layer


def test_matches_the_per_token_reference_eager_and_through_the_op() -> None:
    g = torch.Generator().manual_seed(1)
    x, logits = torch.randn(9, H, generator=g), torch.randn(9, E, generator=g)
    want = _reference(x, logits, _checkpoint())
    layer = _layer()
    torch.testing.assert_close(layer.forward_local(x, logits), want, atol=1e-5, rtol=1e-5)
    assert (x @ _checkpoint()["gate_up_proj"][0]).abs().max() > LIMIT  # the clamp binds
    from tokenwise.layers.fused_moe.router import select_experts

    weights, ids = select_experts(logits, K, True)
    op = torch.ops.tokenwise.moe_experts(
        x, layer.w13_weight, layer.w2_weight, weights, ids, 0, True,
        layer.w13_bias, layer.w2_bias, "swigluoai", ALPHA, LIMIT,
    )  # fmt: skip
    torch.testing.assert_close(op, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("ep", [False, True], ids=["intermediate-sharded", "expert-parallel"])
def test_two_shards_add_up_to_the_whole(ep: bool) -> None:
    """Each DP rank's partial sum (the down bias added once over the shards)."""
    g = torch.Generator().manual_seed(2)
    x, logits = torch.randn(7, H, generator=g), torch.randn(7, E, generator=g)
    parts = [
        _layer(
            ParallelConfig(data_parallel_size=2, data_parallel_rank=r, enable_expert_parallel=ep)
        )
        for r in (0, 1)
    ]
    total = sum(p.forward_local(x, logits) for p in parts)
    torch.testing.assert_close(total, _reference(x, logits, _checkpoint()), atol=1e-5, rtol=1e-5)


def test_refuses_unknown_tensors_and_shapes() -> None:
    layer = _layer()
    with pytest.raises(ValueError, match="unexpected expert tensor 'gate_proj'"):
        layer.load_stacked("gate_proj", torch.zeros(1))
    with pytest.raises(ValueError, match="shape mismatch"):
        layer.load_stacked("down_proj_bias", torch.zeros(E, H + 1))


def test_grouped_matmul_and_loop_add_the_biases_alike() -> None:
    """The grouped-matmul path (what CUDA graphs capture: no host read) equals the loop."""
    from tokenwise.layers.fused_moe.experts import fused_experts, grouped_mm_supported
    from tokenwise.layers.fused_moe.router import select_experts

    g = torch.Generator().manual_seed(3)
    x, logits = torch.randn(11, H, generator=g), torch.randn(11, E, generator=g)
    if not grouped_mm_supported(x):
        pytest.skip("no torch._grouped_mm here")
    layer = _layer()
    weights, ids = select_experts(logits, K, True)
    args = (x, layer.w13_weight, layer.w2_weight, weights, ids, layer.act_and_mul)
    biases = {"w13_bias": layer.w13_bias, "w2_bias": layer.w2_bias, "weights_in_fp32": True}
    loop = fused_experts(*args, use_grouped_mm=False, **biases)
    grouped = fused_experts(*args, use_grouped_mm=True, **biases)
    torch.testing.assert_close(grouped, loop, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loop, _reference(x, logits, _checkpoint()), atol=1e-5, rtol=1e-5)
