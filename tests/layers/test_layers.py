"""Layer building blocks against hand-written references."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tokenwise.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    SiluAndMul,
    VocabParallelEmbedding,
    get_rope_config,
)


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------- RMSNorm


def _rms_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return (x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + eps) * weight.double()).float()


def test_rmsnorm_without_and_with_residual() -> None:
    norm = RMSNorm(16, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(_randn(16, seed=1))
    x, residual = _randn(5, 16), _randn(5, 16, seed=2) * 3
    torch.testing.assert_close(norm(x), _rms_reference(x, norm.weight, 1e-5))
    normed, new_residual = norm(x, residual)
    torch.testing.assert_close(new_residual, x + residual)
    torch.testing.assert_close(normed, _rms_reference(x + residual, norm.weight, 1e-5))


def test_rmsnorm_bf16_normalises_in_fp32_and_returns_bf16() -> None:
    norm = RMSNorm(64).to(torch.bfloat16)
    x = (_randn(4, 64) * 1000).to(torch.bfloat16)  # squares would lose precision in bf16
    out = norm(x)
    assert out.dtype == torch.bfloat16
    expected = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(
        torch.bfloat16
    )
    assert torch.equal(out, expected)


# --------------------------------------------------------------------------------- rotary


def _rope_reference(
    x: torch.Tensor, positions: list[int], head_dim: int, inv_freq: list[float]
) -> torch.Tensor:
    """Element by element: pair i of a head is (x[i], x[i + d/2]) rotated by pos * inv_freq[i]."""
    out = torch.empty_like(x)
    heads = x.view(len(positions), -1, head_dim)
    result = out.view_as(heads)
    half = head_dim // 2
    for t, pos in enumerate(positions):
        for h in range(heads.shape[1]):
            for i in range(half):
                c, s = math.cos(pos * inv_freq[i]), math.sin(pos * inv_freq[i])
                a, b = heads[t, h, i].item(), heads[t, h, i + half].item()
                result[t, h, i] = a * c - b * s
                result[t, h, i + half] = b * c + a * s
    return out


def _default_inv_freq(head_dim: int, base: float) -> list[float]:
    return [base ** (-2 * i / head_dim) for i in range(head_dim // 2)]


@pytest.mark.parametrize("shape_3d", [False, True])
def test_rotary_matches_reference_at_noncontiguous_positions(shape_3d: bool) -> None:
    head_dim, base, positions = 8, 10000.0, [5, 0, 17]
    rope = RotaryEmbedding(head_dim, max_position=32, base=base)
    q, k = _randn(3, 2 * head_dim), _randn(3, head_dim, seed=1)
    if shape_3d:
        q, k = q.view(3, 2, head_dim), k.view(3, 1, head_dim)
    q_out, k_out = rope(torch.tensor(positions), q, k)
    assert q_out.shape == q.shape and k_out.shape == k.shape
    inv_freq = _default_inv_freq(head_dim, base)
    torch.testing.assert_close(q_out, _rope_reference(q, positions, head_dim, inv_freq))
    torch.testing.assert_close(k_out, _rope_reference(k, positions, head_dim, inv_freq))
    assert torch.equal(q_out[1], q[1])  # position 0 is the identity


def _angles_at_position_one(rope: RotaryEmbedding) -> torch.Tensor:
    cos, sin = rope.cos_sin_cache[1].double().chunk(2)
    return torch.atan2(sin, cos)


def test_linear_scaling_divides_every_frequency() -> None:
    plain = RotaryEmbedding(16, 8, base=10000.0)
    scaled = RotaryEmbedding(16, 8, 10000.0, {"rope_type": "linear", "factor": 4.0})
    torch.testing.assert_close(_angles_at_position_one(scaled), _angles_at_position_one(plain) / 4)


def test_llama3_scaling_changes_only_low_frequencies() -> None:
    head_dim, base = 32, 10000.0
    factor, low, high, original = 8.0, 1.0, 4.0, 128
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": original,
    }
    got = _angles_at_position_one(RotaryEmbedding(head_dim, 8, base, scaling))
    # Re-derived from the Llama 3.1 recipe: keep wavelengths shorter than original/high,
    # divide those longer than original/low by `factor`, blend linearly in between.
    kinds = []
    for i, freq in enumerate(_default_inv_freq(head_dim, base)):
        wavelength = 2 * math.pi / freq
        if wavelength < original / high:
            expected, kind = freq, "kept"
        elif wavelength > original / low:
            expected, kind = freq / factor, "scaled"
        else:
            blend = (original / wavelength - low) / (high - low)
            expected, kind = (1 - blend) * freq / factor + blend * freq, "blended"
            assert freq / factor < expected < freq
        kinds.append(kind)
        assert got[i].item() == pytest.approx(expected, rel=1e-5), (i, kind)
    assert {"kept", "scaled", "blended"} <= set(kinds)


def test_unsupported_rope_type_is_named() -> None:
    with pytest.raises(NotImplementedError, match="longrope"):
        RotaryEmbedding(16, 8, 10000.0, {"rope_type": "longrope", "factor": 4.0})


def test_yarn_without_its_original_length_is_named() -> None:
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        RotaryEmbedding(16, 8, 10000.0, {"rope_type": "yarn", "factor": 4.0})


# ------------------------------------------------------------------------ get_rope_config


@pytest.mark.parametrize(
    ("attrs", "expected"),
    [
        ({}, (10000.0, None)),
        # transformers 4.x: separate attributes; old files say "type", newer "rope_type".
        ({"rope_theta": 5e5, "rope_scaling": None}, (5e5, None)),
        (
            {"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}},
            (5e5, {"rope_type": "linear", "factor": 2.0}),
        ),
        # transformers 5.x: one rope_parameters dict that also carries the theta.
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, (1e6, None)),
        (
            {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}},
            (5e5, {"rope_type": "llama3", "factor": 8.0}),
        ),
    ],
)
def test_get_rope_config_reads_both_config_forms(attrs: dict, expected: tuple) -> None:
    assert get_rope_config(SimpleNamespace(**attrs)) == expected


def test_get_rope_config_on_a_real_transformers_config() -> None:
    from transformers import LlamaConfig

    config = LlamaConfig(rope_theta=123.0, rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert get_rope_config(config) == (123.0, {"rope_type": "linear", "factor": 2.0})


# ------------------------------------------------------------------------- fused linears


def test_qkv_weight_loader_puts_shards_in_their_rows() -> None:
    layer = QKVParallelLinear(hidden_size=4, head_dim=2, num_heads=2, num_kv_heads=1, bias=True)
    assert layer.weight.shape == (8, 4) and layer.output_sizes == [4, 2, 2]
    shards = {"q": _randn(4, 4), "k": _randn(2, 4, seed=1), "v": _randn(2, 4, seed=2)}
    biases = {"q": _randn(4, seed=3), "k": _randn(2, seed=4), "v": _randn(2, seed=5)}
    for shard_id in ("v", "q", "k"):  # order must not matter
        layer.weight.weight_loader(layer.weight, shards[shard_id], shard_id)
        layer.bias.weight_loader(layer.bias, biases[shard_id], shard_id)
    assert torch.equal(layer.weight[0:4], shards["q"])
    assert torch.equal(layer.weight[4:6], shards["k"])
    assert torch.equal(layer.weight[6:8], shards["v"])
    x = _randn(3, 4, seed=6)
    q, k, v = layer(x).split(layer.output_sizes, dim=-1)
    torch.testing.assert_close(k, F.linear(x, shards["k"], biases["k"]))
    with pytest.raises(ValueError, match=r"\(2, 4\).*\(4, 4\)"):
        layer.weight.weight_loader(layer.weight, shards["q"], "k")
    with pytest.raises(ValueError, match="'x'"):
        layer.weight.weight_loader(layer.weight, shards["q"], "x")


def test_gate_up_loader_and_silu_and_mul() -> None:
    layer = MergedColumnParallelLinear(4, [3, 3])
    gate, up = _randn(3, 4), _randn(3, 4, seed=1)
    layer.weight.weight_loader(layer.weight, up, 1)
    layer.weight.weight_loader(layer.weight, gate, 0)
    assert torch.equal(layer.weight[:3], gate) and torch.equal(layer.weight[3:], up)
    x = _randn(2, 4, seed=2)
    torch.testing.assert_close(SiluAndMul()(layer(x)), F.silu(x @ gate.T) * (x @ up.T))


def test_tied_lm_head_shares_the_embedding_and_returns_fp32() -> None:
    embed = VocabParallelEmbedding(10, 4).to(torch.bfloat16)
    with torch.no_grad():
        embed.weight.copy_(_randn(10, 4))
    head = ParallelLMHead(10, 4, tie_to=embed)
    assert head.weight is embed.weight
    hidden = embed(torch.tensor([1, 7]))
    logits = head(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (2, 10)
    expected = hidden.float() @ embed.weight.float().T
    torch.testing.assert_close(logits, expected, atol=0.05, rtol=0.02)  # bf16 matmul rounding
