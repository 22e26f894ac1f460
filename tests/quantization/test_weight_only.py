"""Group-quantized int8 / int4 weights: the format, the C kernels and the quantizer.

The reference is `reference_dequantize` (torch ops written from the format's definition) and,
for the bytes themselves, gguf-py's numpy quantizers, which follow llama.cpp's: our
symmetric int8 / int4 quantization of a matrix must give Q8_0's and Q4_0's integers and float16
scales for the same values, block for block.
"""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenwise.layers.quantization import weight_only
from tokenwise.layers.quantization.weight_only import (
    pack_int4,
    quantize,
    reference_dequantize,
    unpack_int4,
)
from tokenwise.native import qgemv as cpu_qgemv

FORMATS = [(8, True), (8, False), (4, True), (4, False)]
Q = gguf.GGMLQuantizationType


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Rows of different magnitudes and a few outliers, as trained weights have.
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)
    w[0, 3] = 9.0
    return w


@pytest.mark.parametrize(("bits", "symmetric"), FORMATS)
@pytest.mark.parametrize("group", [32, 64, 128])
def test_kernel_matches_the_reference_at_every_row_count(
    bits: int, symmetric: bool, group: int
) -> None:
    qw = quantize(_weight(72, 256), bits, group, symmetric)
    dense = reference_dequantize(qw)
    for rows in (1, 2, 3, 5, 8, 9, 20, 33):  # one kernel call, blocks of 8, then dequantized
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
        bias = torch.randn(72)
        expected = x @ dense.T + bias
        torch.testing.assert_close(qw.linear(x, bias), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(("bits", "symmetric"), FORMATS)
def test_bf16_activations_are_as_close_as_bf16_allows(
    bits: int, symmetric: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 x with TOKENWISE_CPU_QUANT_ACTIVATIONS=int16 runs the int16 path: x as int16 per
    group (an error of at most 2^-16 of the group's largest value), sums in int32, one bf16
    rounding at the end. (The default int8 path: test_qgemv_activations.py.)"""
    monkeypatch.setenv(cpu_qgemv.ACTIVATIONS_ENV, "int16")
    cpu_qgemv.activation_bits.cache_clear()
    monkeypatch.setattr(cpu_qgemv, "activation_bits", lambda: 16)
    qw = quantize(_weight(64, 128), bits, 32, symmetric)
    dense = reference_dequantize(qw)
    for rows in (1, 3, 8):
        x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows))
        x = x.to(torch.bfloat16)
        out = qw.linear(x, None)
        assert out.dtype == torch.bfloat16
        expected = x.float() @ dense.T
        # One bf16 rounding of the result, plus x's int16 rounding through |W| (2^-16 of each
        # group's largest |x|, bounded here by the row's largest |x|).
        magnitude = x.float().abs().amax(dim=1, keepdim=True) @ dense.abs().sum(1, keepdim=True).T
        allowed = expected.abs() * 2**-8 + magnitude * 2**-15 + 1e-6
        assert ((out.float() - expected).abs() <= allowed).all()


@pytest.mark.parametrize(("bits", "symmetric"), FORMATS)
def test_dense_weights_from_the_kernel_equal_the_reference(bits: int, symmetric: bool) -> None:
    qw = quantize(_weight(48, 96), bits, 32, symmetric)
    reference = reference_dequantize(qw)
    assert torch.equal(qw.dequantize(torch.float32), reference)
    assert torch.equal(qw.dequantize(torch.bfloat16), reference.to(torch.bfloat16))


def test_float32_scales_and_offsets() -> None:
    """Formats whose scales float16 cannot hold (products such as -z * s) keep float32 ones."""
    qw = quantize(_weight(40, 128), 4, 32, False)
    wide = dataclasses.replace(
        qw, scales=qw.scales.float() * 1.001, offsets=qw.offsets.float() * 0.999
    )
    dense = reference_dequantize(wide)
    assert not torch.equal(dense, reference_dequantize(qw))
    # q * s is no longer exact in float32, so a fused multiply-add may round differently.
    torch.testing.assert_close(wide.dequantize(torch.float32), dense, rtol=1e-6, atol=1e-7)
    x = torch.randn(5, 128)
    torch.testing.assert_close(wide.linear(x, None), x @ dense.T, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="offsets must have the scales' dtype"):
        dataclasses.replace(qw, scales=qw.scales.float())


def test_torch_fallback_computes_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the C kernel (no compiler, not libgomp) layers dequantize with torch ops."""
    qw = quantize(_weight(40, 64), 4, 32, False)
    x = torch.randn(3, 64)
    with_kernel = qw.linear(x, None)
    monkeypatch.setattr(cpu_qgemv, "load", lambda: None)
    monkeypatch.setattr(weight_only.cpu_qgemv, "load", lambda: None)
    torch.testing.assert_close(qw.linear(x, None), with_kernel, rtol=1e-5, atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(
    bits_sym=st.sampled_from(FORMATS),
    rows=st.integers(1, 6),
    groups=st.integers(1, 4),
    scale=st.floats(1e-3, 1e3),
    seed=st.integers(0, 2**16),
)
def test_rounding_error_is_at_most_half_a_step(
    bits_sym: tuple[int, bool], rows: int, groups: int, scale: float, seed: int
) -> None:
    bits, symmetric = bits_sym
    w = torch.randn(rows, 32 * groups, generator=torch.Generator().manual_seed(seed)) * scale
    qw = quantize(w, bits, 32, symmetric)
    step = qw.scales.float().abs().repeat_interleave(32, dim=1)
    error = (reference_dequantize(qw) - w).abs()
    # Half a step, plus the float16 rounding of the scale and offset (relative 2^-11 of the
    # values they reach) and float32 arithmetic.
    slack = w.abs().amax(dim=1, keepdim=True) * 2**-9 + 1e-6 * scale
    allowed = step / 2
    if bits == 4 and symmetric:
        # Q4_0 maps the largest magnitude to -8: the other side reaches only +7 steps, so a
        # value beyond 7.5 steps there is clipped, by at most one step.
        allowed = torch.where(w.abs() > 7.5 * step, step, allowed)
    assert (error <= allowed + slack).all()
    if bits == 8 and symmetric:  # the largest value of every group uses the full range
        q = qw.qweight.reshape(rows, groups, 32).abs().amax(-1)
        assert (q == 127).all()


def test_int4_packing_round_trips_in_gguf_nibble_order() -> None:
    values = torch.randint(0, 16, (3, 64), dtype=torch.uint8)
    packed = pack_int4(values)
    assert packed.shape == (3, 32)
    assert torch.equal(unpack_int4(packed), values)
    # Byte j of a 32-value block: value j in the low nibble, value j + 16 in the high one.
    assert int(packed[1, 5]) == int(values[1, 5]) | (int(values[1, 21]) << 4)
    assert int(packed[2, 16 + 7]) == int(values[2, 32 + 7]) | (int(values[2, 48 + 7]) << 4)


@pytest.mark.parametrize(("qtype", "bits"), [(Q.Q8_0, 8), (Q.Q4_0, 4)])
def test_symmetric_formats_are_llama_cpp_blocks(qtype: Q, bits: int) -> None:
    """Our int8 / int4 symmetric quantization of a matrix is gguf-py's (llama.cpp's) Q8_0 /
    Q4_0 of it: the same float16 scale and the same integers in every block."""
    w = _weight(16, 128, seed=3).numpy()
    blocks = gguf.quants.quantize(w, qtype).reshape(16, 4, -1)  # [rows, blocks, bytes]
    scales = blocks[..., :2].copy().view(np.float16)[..., 0]
    ours = quantize(torch.from_numpy(w), bits, 32, symmetric=True)
    assert np.array_equal(ours.scales.numpy(), scales)
    data = blocks[..., 2:].reshape(16, -1)
    if bits == 8:
        assert np.array_equal(ours.qweight.numpy(), data.view(np.int8))
    else:
        assert np.array_equal(ours.qweight.numpy(), data)


def test_bad_arguments_name_the_parameter() -> None:
    with pytest.raises(ValueError, match="bits"):
        quantize(torch.randn(4, 32), 3)
    with pytest.raises(ValueError, match="group_size.*multiple of 32"):
        quantize(torch.randn(4, 64), 4, group_size=16)
    with pytest.raises(ValueError, match="group_size.*dividing the input size 48"):
        quantize(torch.randn(4, 48), 8, group_size=32)


def test_bytes_per_weight() -> None:
    w = _weight(64, 256)
    assert quantize(w, 8, 32).nbytes == 64 * 256 * 34 // 32  # Q8_0's 34 bytes per 32
    assert quantize(w, 4, 32, True).nbytes == 64 * 256 * 18 // 32  # Q4_0's 18
    assert quantize(w, 4, 32, False).nbytes == 64 * 256 * 20 // 32  # Q4_1's 20
