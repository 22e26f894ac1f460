"""The fused decode step of a Gated DeltaNet layer (`native.gdn_decode.gated_delta_decode_step`:
conv, gates, delta rule and gated norm in one C call) against the layer's op-by-op path, on one
layer with random weights and states, in float32 and bfloat16, for decode requests in
scattered state slots; and the step is declined (general path) where it does not apply."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tokenwise.attention.recurrent import RecurrentMetadata
from tokenwise.models import gated_deltanet
from tokenwise.models.gated_deltanet import GatedDeltaNet
from tokenwise.native import gdn_decode

needs_kernel = pytest.mark.skipif(gdn_decode.load() is None, reason="no C compiler here")


class _Config(dict):
    """What the layer reads of an engine config (and the dict its layer registry is)."""

    def __init__(self, dv: int) -> None:
        super().__init__()
        hf = SimpleNamespace(
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=dv, linear_conv_kernel_dim=4, hidden_size=48, rms_norm_eps=1e-6,
        )  # fmt: skip
        self.model = SimpleNamespace(hf_config=hf)


def _layer(dtype: torch.dtype, dv: int) -> GatedDeltaNet:
    torch.manual_seed(0)
    layer = GatedDeltaNet(_Config(dv), "layers.0.linear_attn")  # type: ignore[arg-type]
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(torch.randn(p.shape) * (0.3 if "proj" in name else 0.5))
        layer.norm.weight.add_(1.0)
    return layer.to(dtype)


def _run(layer, x, states, md, fused: bool, monkeypatch) -> torch.Tensor:
    with monkeypatch.context() as m:
        if not fused:
            m.setattr(gated_deltanet, "gated_delta_decode_step", lambda *a: False)
        return layer.mix(x, states, md)


@needs_kernel
@pytest.mark.parametrize("dv", [16, 20])  # 20: vector tails on AVX2 and AVX-512
def test_the_fused_step_equals_the_op_by_op_path_in_float32(dv: int, monkeypatch) -> None:
    layer = _layer(torch.float32, dv)
    x = torch.randn(3, 48)
    states = torch.randn(6, layer.state_numel) * 0.1
    md = RecurrentMetadata([4, 0, 2], [0, 1, 2, 3], [False] * 3)
    want_states = states.clone()
    want = _run(layer, x, want_states, md, False, monkeypatch)
    got = _run(layer, x, states, md, True, monkeypatch)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(states, want_states, atol=2e-6, rtol=1e-5)  # slots 1, 3, 5 too


@needs_kernel
def test_the_fused_step_in_bfloat16_is_the_float32_step_rounded_once(monkeypatch) -> None:
    """bf16 weights, inputs and states: the fused step computes in float32 and rounds where it
    stores, so it lies within bf16 rounding of the float32 step on the same (bf16) values;
    the op-by-op path rounds every intermediate and lies further off."""
    layer = _layer(torch.bfloat16, 16)
    x = torch.randn(3, 48).to(torch.bfloat16)
    states = (torch.randn(6, layer.state_numel) * 0.1).to(torch.bfloat16)
    md = RecurrentMetadata([4, 0, 2], [0, 1, 2, 3], [False] * 3)
    ref_states = states.float()
    ref = _run(layer.float(), x.float(), ref_states, md, True, monkeypatch)
    layer = layer.to(torch.bfloat16)
    op_states = states.clone()
    op_by_op = _run(layer, x, op_states, md, False, monkeypatch)
    got = _run(layer, x, states, md, True, monkeypatch)
    assert got.dtype == states.dtype == torch.bfloat16
    scale = ref.abs().max()
    err, op_err = ((y.float() - ref).abs().max() / scale for y in (got, op_by_op))
    assert err < 1e-2 and err <= op_err  # measured 0.004 and 0.006: out_proj's bf16 roundings
    torch.testing.assert_close(states.float(), ref_states, atol=1e-3, rtol=8e-3)
    assert (got.float() - ref).abs().mean() <= (op_by_op.float() - ref).abs().mean()


@needs_kernel
def test_prefills_and_kept_token_states_take_the_general_path(monkeypatch) -> None:
    layer = _layer(torch.float32, 16)
    calls: list[int] = []
    real = gated_deltanet.gated_delta_decode_step
    monkeypatch.setattr(
        gated_deltanet, "gated_delta_decode_step", lambda *a: calls.append(1) or real(*a)
    )
    states = torch.zeros(4, layer.state_numel)
    layer.mix(torch.randn(3, 48), states, RecurrentMetadata([0, 1], [0, 2, 3], [False] * 2))
    layer.mix(torch.randn(2, 48), states, RecurrentMetadata([0, 1], [0, 1, 2], [True, False]))
    assert calls == []
    layer.mix(torch.randn(2, 48), states, RecurrentMetadata([0, 1], [0, 1, 2], [False] * 2))
    assert calls == [1]


@needs_kernel
def test_bad_slots_and_widths_are_refused_by_name() -> None:
    layer = _layer(torch.float32, 16)
    proj, out = torch.zeros(1, 128 + 64 + 8), torch.zeros(1, 64)
    args = (layer.conv1d.weight.view(128, 4), layer.A_log, layer.dt_bias, layer.norm.weight, 1e-6)
    states = torch.zeros(2, layer.state_numel)
    idx = gdn_decode.index_tensor
    with pytest.raises(ValueError, match=r"status -3: .* every slot below 2"):
        gdn_decode.gated_delta_decode_step(
            proj, idx([0]), states, idx([2]), *args, out, (2, 4, 16, 16)
        )
    with pytest.raises(ValueError, match=r"state slots must lie in \[0, 2\), got \[2\]"):
        layer.mix(torch.zeros(1, 48), states, RecurrentMetadata([2], [0, 1], [False]))
    with pytest.raises(ValueError, match="in_proj output width 199"):
        gdn_decode.gated_delta_decode_step(
            proj[:, 1:], idx([0]), states, idx([0]), *args, out, (2, 4, 16, 16)
        )
