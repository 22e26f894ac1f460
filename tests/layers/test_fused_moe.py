"""The MoE layer against hand-written references and transformers' own MoE blocks.

Routing and the grouped expert computation are compared with a per-token loop and with HF;
the DP shards (whole experts, or intermediate slices) must add up to the unsharded output;
loading is strict about missing tensors but skips other ranks' experts.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tokenwise.config import EngineConfig, ParallelConfig
from tokenwise.forward_context import DPMetadata, create_forward_context, override_forward_context
from tokenwise.layers.activation import SiluAndMul
from tokenwise.layers.fused_moe import (
    ExpertShard,
    FusedMoE,
    fused_experts,
    load_weights_with_experts,
    make_expert_params_mapping,
    select_experts,
)
from tokenwise.layers.fused_moe.experts import grouped_mm_supported

E, K, H, INTER = 8, 2, 32, 16  # experts, top-k, hidden, expert intermediate size


def _randn(*shape: int, seed: int = 0, std: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * std


def _config(dp: int = 1, rank: int = 0, ep: bool = False) -> EngineConfig:
    return EngineConfig(
        parallel=ParallelConfig(
            data_parallel_size=dp, data_parallel_rank=rank, enable_expert_parallel=ep
        )
    )


class Block(nn.Module):
    """A container, so that tensor names look like a checkpoint's (`experts.3.w1.weight`)."""

    def __init__(self, config: EngineConfig, renormalize: bool = True) -> None:
        super().__init__()
        self.experts = FusedMoE(E, K, H, INTER, config, renormalize=renormalize, prefix="experts")


def _full_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """Per-expert gate (w1), up (w3) and down (w2) weights of all E experts, Mixtral-named."""
    return {
        f"experts.{e}.{proj}.weight": _randn(*shape, seed=seed + 3 * e + j, std=0.3)
        for e in range(E)
        for j, (proj, shape) in enumerate(
            (("w1", (INTER, H)), ("w3", (INTER, H)), ("w2", (H, INTER)))
        )
    }


def _stacked(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5's in-memory form: `gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`."""

    def w(e: int, proj: str) -> torch.Tensor:
        return weights[f"experts.{e}.{proj}.weight"]

    gate_up = torch.stack([torch.cat([w(e, "w1"), w(e, "w3")]) for e in range(E)])
    down = torch.stack([w(e, "w2") for e in range(E)])
    return {"experts.gate_up_proj": gate_up, "experts.down_proj": down}


def _load(block: Block, weights: dict[str, torch.Tensor]) -> set[str]:
    mapping = make_expert_params_mapping(E, "w1", "w3", "w2")
    return load_weights_with_experts(block, weights.items(), (), mapping)


def _loaded_block(config: EngineConfig, renormalize: bool = True) -> Block:
    block = Block(config, renormalize)
    _load(block, _full_weights())
    return block


# ---------------------------------------------------------------------------------- router


@pytest.mark.parametrize("renormalize", [True, False])
def test_select_experts_matches_a_per_row_reference(renormalize: bool) -> None:
    logits = _randn(17, E, seed=1, std=2.0).to(torch.bfloat16)
    weights, ids = select_experts(logits, K, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert weights.shape == ids.shape == (17, K)
    for t in range(17):
        probs = torch.softmax(logits[t].double(), dim=0)  # the softmax runs over all E
        order = sorted(range(E), key=lambda e: -probs[e].item())[:K]
        chosen = probs[order]
        if renormalize:
            chosen = chosen / chosen.sum()
        assert ids[t].tolist() == order
        torch.testing.assert_close(weights[t].double(), chosen, atol=1e-6, rtol=0)
    sums = weights.sum(dim=-1)
    if renormalize:
        torch.testing.assert_close(sums, torch.ones(17))
    else:
        assert (sums < 0.99).all()  # top-2 of 8 never holds all the mass here


def _hf_router(model_type: str, norm_topk_prob: bool) -> Any:
    from transformers import AutoConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    if model_type == "mixtral":
        config = AutoConfig.for_model("mixtral", hidden_size=H, num_local_experts=E)
        router = MixtralTopKRouter(config)
    else:
        config = AutoConfig.for_model(
            "qwen3_moe", hidden_size=H, num_experts=E, norm_topk_prob=norm_topk_prob
        )
        router = Qwen3MoeTopKRouter(config)
    router.top_k = K
    with torch.no_grad():
        router.weight.copy_(_randn(E, H, seed=2, std=0.3))
    return router


@pytest.mark.parametrize(
    ("model_type", "renormalize"), [("mixtral", True), ("qwen3_moe", True), ("qwen3_moe", False)]
)
def test_select_experts_equals_hf_routers(model_type: str, renormalize: bool) -> None:
    router = _hf_router(model_type, renormalize)
    x = _randn(23, H, seed=3)
    with torch.no_grad():
        logits, hf_weights, hf_ids = router(x)
    weights, ids = select_experts(F.linear(x, router.weight), K, renormalize)
    assert torch.equal(ids, hf_ids)
    assert torch.equal(weights, hf_weights.float())


# ------------------------------------------------------------------------- expert compute


def _naive_moe(
    x: torch.Tensor, logits: torch.Tensor, weights: dict[str, torch.Tensor], renormalize: bool
) -> torch.Tensor:
    """Token by token, expert by expert: the definition of the MoE output."""
    out = torch.zeros_like(x, dtype=torch.float64)
    for t in range(x.shape[0]):
        probs = torch.softmax(logits[t].double(), dim=0)
        top = torch.topk(probs, K)
        scale = top.values / top.values.sum() if renormalize else top.values
        for w, e in zip(scale.tolist(), top.indices.tolist(), strict=True):

            def proj(name: str, v: torch.Tensor, e: int = e) -> torch.Tensor:
                return weights[f"experts.{e}.{name}.weight"].double() @ v

            xt = x[t].double()
            out[t] += w * proj("w2", F.silu(proj("w1", xt)) * proj("w3", xt))
    return out.float()


@pytest.mark.parametrize("renormalize", [True, False])
def test_forward_local_matches_per_token_reference(renormalize: bool) -> None:
    block = _loaded_block(_config(), renormalize)
    x, logits = _randn(13, H, seed=5), _randn(13, E, seed=6, std=2.0)
    out = block.experts.forward_local(x, logits)
    torch.testing.assert_close(
        out, _naive_moe(x, logits, _full_weights(), renormalize), atol=1e-5, rtol=0
    )
    # Without a forward context and DP, forward is the same computation.
    assert torch.equal(block.experts(x, logits), out)


def test_experts_without_tokens_and_an_empty_batch() -> None:
    block = _loaded_block(_config())
    logits = torch.full((3, E), -10.0)
    logits[:, 5], logits[:, 2] = 3.0, 2.0  # every token goes to experts 5 and 2 only
    x = _randn(3, H, seed=7)
    out = block.experts.forward_local(x, logits)
    torch.testing.assert_close(out, _naive_moe(x, logits, _full_weights(), True), atol=1e-5, rtol=0)
    empty = block.experts.forward_local(x[:0], logits[:0])
    assert empty.shape == (0, H)


def test_compiles_as_one_graph() -> None:
    """The per-expert loop needs host-side group sizes; behind its custom op a fullgraph
    compile (what the engine uses) traces the layer without a graph break."""
    moe = _loaded_block(_config()).experts
    compiled = torch.compile(moe, fullgraph=True, backend="eager", dynamic=True)
    for n in (7, 19):
        x, logits = _randn(n, H, seed=n), _randn(n, E, seed=n + 1, std=2.0)
        torch.testing.assert_close(compiled(x, logits), moe(x, logits), atol=0, rtol=0)


def test_only_silu_experts() -> None:
    with pytest.raises(NotImplementedError, match="gelu"):
        FusedMoE(E, K, H, INTER, _config(), renormalize=True, hidden_act="gelu")


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_bf16_rounding_equals_hf_moe_block(model_type: str) -> None:
    """HF scales Mixtral's expert outputs by fp32 weights but rounds Qwen's weights to bf16
    first, then sums a token's experts in fp32; matching that gives HF's bits exactly, and
    the other choice does not."""
    from transformers import AutoConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    common = {"hidden_size": H, "num_experts_per_tok": K}
    if model_type == "mixtral":
        config = AutoConfig.for_model(
            model_type, intermediate_size=INTER, num_local_experts=E, **common
        )
        hf: nn.Module = MixtralSparseMoeBlock(config)
    else:
        config = AutoConfig.for_model(
            model_type, moe_intermediate_size=INTER, num_experts=E, norm_topk_prob=True, **common
        )
        hf = Qwen3MoeSparseMoeBlock(config)
    # What `from_pretrained` picks by default (a standalone block would fall back to eager,
    # which rounds every expert's contribution to bf16 before adding).
    config._experts_implementation = "grouped_mm"
    hf = hf.to(torch.bfloat16)
    for seed, p in enumerate(hf.parameters()):
        with torch.no_grad():
            p.copy_(_randn(*p.shape, seed=seed, std=0.3))
    x = _randn(64, H, seed=9).to(torch.bfloat16)
    with torch.no_grad():
        expected = hf(x[None])[0]
    outputs = {}
    for fp32_weights in (True, False):
        moe = FusedMoE(E, K, H, INTER, _config(), renormalize=True, weights_in_fp32=fp32_weights)
        moe = moe.to(torch.bfloat16)
        with torch.no_grad():
            moe.w13_weight.copy_(hf.experts.gate_up_proj)
            moe.w2_weight.copy_(hf.experts.down_proj)
        outputs[fp32_weights] = moe.forward_local(x, F.linear(x, hf.gate.weight))
    right = model_type == "mixtral"
    assert torch.equal(outputs[right], expected)
    assert not torch.equal(outputs[not right], expected)


# ------------------------------------------------------------------------------ DP shards


@pytest.mark.parametrize("form", ["per-expert", "stacked"])
@pytest.mark.parametrize("ep", [True, False], ids=["expert-parallel", "intermediate-sharded"])
def test_dp_shards_sum_to_the_unsharded_output(ep: bool, form: str) -> None:
    weights = _full_weights() if form == "per-expert" else _stacked(_full_weights())
    full = Block(_config())
    _load(full, weights)
    x, logits = _randn(29, H, seed=11), _randn(29, E, seed=12, std=2.0)
    expected = full.experts.forward_local(x, logits)
    partials = []
    for rank in (0, 1):
        block = Block(_config(dp=2, rank=rank, ep=ep))
        assert _load(block, weights) == {"experts.w13_weight", "experts.w2_weight"}
        moe = block.experts
        if ep:  # half the experts, each whole
            assert moe.w13_weight.shape == (E // 2, 2 * INTER, H)
            assert moe.w2_weight.shape == (E // 2, H, INTER)
        else:  # every expert, half of its intermediate dimension
            assert moe.w13_weight.shape == (E, INTER, H)
            assert moe.w2_weight.shape == (E, H, INTER // 2)
        partials.append(moe.forward_local(x, logits))
    assert not torch.allclose(partials[0], expected, atol=1e-3)  # each is really partial
    torch.testing.assert_close(partials[0] + partials[1], expected, atol=1e-5, rtol=0)


def test_shard_sizes_must_divide() -> None:
    with pytest.raises(ValueError, match=r"num_experts \(6\).*data_parallel_size \(4\)"):
        FusedMoE(6, K, H, INTER, _config(dp=4, rank=1, ep=True), renormalize=True)
    with pytest.raises(ValueError, match=r"data_parallel_size \(4\).*intermediate size \(30\)"):
        FusedMoE(E, K, H, 30, _config(dp=4, rank=1, ep=False), renormalize=True)
    FusedMoE(6, K, H, 32, _config(dp=2, rank=1, ep=False), renormalize=True)  # I divides: fine


@pytest.mark.parametrize("ep", [False, True])
def test_dp_times_tp_shards_tile_the_experts_exactly_once(
    ep: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under DP=2 x TP=2 the four processes' shards are disjoint and cover every expert's whole
    intermediate dimension (ordered dp_rank * tp + tp_rank), so the DP and TP sums add up."""
    import tokenwise.layers.fused_moe.sharding as sharding

    monkeypatch.setattr(sharding, "get_tp_size", lambda: 2)
    covered = torch.zeros(E, INTER, dtype=torch.int64)
    order = []
    for dp_rank in range(2):
        for tp_rank in range(2):
            monkeypatch.setattr(sharding, "get_tp_rank", lambda r=tp_rank: r)
            shard = ExpertShard.for_rank(_config(dp=2, rank=dp_rank, ep=ep).parallel, E, INTER)
            experts = slice(shard.first_expert, shard.first_expert + shard.num_local_experts)
            covered[experts, shard.intermediate_slice()] += 1
            order.append(shard.first_expert if ep else shard.intermediate_start)
    assert torch.all(covered == 1)
    assert order == sorted(order)
    with pytest.raises(ValueError, match=r"num_experts \(6\).*tensor_parallel_size \(2\)"):
        ExpertShard.for_rank(_config(dp=2, rank=0, ep=True).parallel, 6, INTER)


def test_sharded_layer_needs_the_dp_forward_context(monkeypatch: pytest.MonkeyPatch) -> None:
    block = _loaded_block(_config(dp=2, rank=1, ep=True))
    x, logits = _randn(5, H, seed=13), _randn(5, E, seed=14)
    with pytest.raises(RuntimeError, match="forward context"):
        block.experts(x, logits)

    import tokenwise.distributed.moe_dispatch as moe_dispatch

    calls: list[tuple[Any, ...]] = []

    def fake_combine(*args: Any) -> torch.Tensor:
        calls.append(args)
        return torch.full_like(x, 7.0)

    monkeypatch.setattr(moe_dispatch, "naive_dispatch_combine", fake_combine)
    config = _config(dp=2, rank=1, ep=True)
    dp = DPMetadata.make(config.parallel, 5, torch.tensor([3, 5]))
    with override_forward_context(create_forward_context(None, config, dp_metadata=dp)):
        out = block.experts(x, logits)
    assert torch.equal(out, torch.full_like(x, 7.0))
    (args,) = calls
    assert args[0] is x and args[1] is logits and args[3] is dp
    assert args[2] == block.experts.forward_local and args[4] is block.experts.parallel


# -------------------------------------------------------------------------------- loading


def test_missing_expert_tensor_is_named() -> None:
    weights = _full_weights()
    del weights["experts.5.w3.weight"]
    with pytest.raises(ValueError, match="missing") as info:
        _load(Block(_config()), weights)
    assert "experts.5.w3.weight" in str(info.value)
    assert "experts.5.w1.weight" not in str(info.value)


def test_other_ranks_experts_may_be_absent_but_not_own() -> None:
    weights = _full_weights()
    for proj in ("w1", "w3", "w2"):
        del weights[f"experts.1.{proj}.weight"]  # rank 0's expert
    block = Block(_config(dp=2, rank=1, ep=True))  # holds experts 4..7
    assert _load(block, weights) == {"experts.w13_weight", "experts.w2_weight"}
    with pytest.raises(ValueError, match=r"experts\.1\.w1\.weight"):
        _load(Block(_config(dp=2, rank=0, ep=True)), weights)


def test_missing_stacked_tensor_is_named_in_stacked_form() -> None:
    weights = _stacked(_full_weights())
    del weights["experts.down_proj"]
    with pytest.raises(ValueError, match="missing") as info:
        _load(Block(_config()), weights)
    assert "experts.down_proj" in str(info.value)
    assert "experts.0.w2.weight" not in str(info.value)


@pytest.mark.parametrize(
    ("name", "bad_shape", "expected"),
    [
        ("experts.3.w2.weight", (H, INTER + 1), (H, INTER)),
        ("experts.gate_up_proj", (E, INTER, H), (E, 2 * INTER, H)),
    ],
)
def test_shape_mismatch_names_tensor_and_shapes(
    name: str, bad_shape: tuple[int, ...], expected: tuple[int, ...]
) -> None:
    weights = _full_weights() if name.count(".") > 1 else _stacked(_full_weights())
    weights[name] = torch.zeros(bad_shape)
    # Even on a rank that does not hold the expert: the checkpoint is wrong either way.
    with pytest.raises(ValueError) as info:
        _load(Block(_config(dp=2, rank=1, ep=True)), weights)
    message = str(info.value)
    assert name in message and str(bad_shape) in message and str(expected) in message


def test_unknown_expert_tensor_is_an_error() -> None:
    weights = _full_weights()
    weights[f"experts.{E}.w1.weight"] = torch.zeros(INTER, H)  # one expert too many
    with pytest.raises(ValueError, match=rf"experts\.{E}\.w1\.weight"):
        _load(Block(_config()), weights)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("first_expert,num_local", [(0, E), (2, 3)])
def test_grouped_matmul_path_equals_the_per_expert_loop(
    dtype: torch.dtype, first_expert: int, num_local: int
) -> None:
    """The device-side grouped matmul (no host sync) gives the loop's result: with every expert
    held, and with a rank holding experts 2..4 only (pairs routed elsewhere count as zero, even
    though the grouped matmul leaves their rows undefined). Some experts get no token."""
    n = 29
    x = _randn(n, H, seed=11).to(dtype)
    w13 = _randn(num_local, 2 * INTER, H, seed=12, std=0.2).to(dtype)
    w2 = _randn(num_local, H, INTER, seed=13, std=0.2).to(dtype)
    ids = torch.randint(0, E - 1, (n, K), generator=torch.Generator().manual_seed(14))
    ids[:, 1] = torch.where(ids[:, 1] == ids[:, 0], E - 1, ids[:, 1])  # distinct per token
    weights = torch.rand(n, K, generator=torch.Generator().manual_seed(15))
    common = dict(first_expert=first_expert, weights_in_fp32=dtype == torch.float32)
    act = SiluAndMul()
    loop = fused_experts(x, w13, w2, weights, ids, act, use_grouped_mm=False, **common)
    grouped = fused_experts(x, w13, w2, weights, ids, act, use_grouped_mm=True, **common)
    assert grouped.dtype == dtype
    # Same products; only the order of the fp32 sum over a token's k experts may differ.
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(grouped, loop, atol=tol, rtol=0)
    held = (ids >= first_expert) & (ids < first_expert + num_local)
    assert torch.all(grouped[~held.any(1)] == 0)  # tokens with no local expert get nothing
    assert grouped_mm_supported(x)  # CPU: the grouped path is the default here
