"""The quantized CPU kernel above 8 rows of x (decode batches of 8-64 sequences): one call tiles
the rows (`run_tiles` in qgemv.c), each block of weights read once for every tile.

Each row of x is quantized and multiplied on its own, so a tiled call must give every row bit
for bit what a one-row call gives it, on every activation path and in both the native and the
AVX2+FMA (`-march=haswell`) build; and the product must be the dense one (the dequantized
weights times x, int8-rounded on the int8 path) written here with torch ops.
"""

from __future__ import annotations

import pytest
import torch

from tokenwise.layers.quantization import weight_only
from tokenwise.layers.quantization.weight_only import quantize, reference_dequantize
from tokenwise.native import qgemv as cpu_qgemv

FORMATS = [(8, True), (4, True), (4, False)]
# (x dtype, x_bits): the exact float path, int8 x from either dtype, bf16 x as int16.
PATHS = [(torch.float32, 32), (torch.float32, 8), (torch.bfloat16, 8), (torch.bfloat16, 16)]
N, K = 37, 512  # 37 weight rows: blocks of rows, then single ones


@pytest.fixture(scope="module")
def libs(haswell_qgemv):
    """The native build (the engine's) and the AVX2+FMA one (built in a temporary cache)."""
    native = cpu_qgemv.load()
    if native is None or native.tw_qgemv_isa() == 0:
        pytest.skip("no vector build of the quantized kernel here (no compiler, AVX2 or libgomp)")
    haswell = cpu_qgemv.open_library(haswell_qgemv[0])
    assert haswell.tw_qgemv_isa() == 1
    return {"native": native, "haswell": haswell}


def _int8_rounded(x: torch.Tensor) -> torch.Tensor:
    """x per 32 values as round(x * 127 / max|x|) * max|x| / 127 (half to even)."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inv) * (amax / torch.full_like(amax, 127.0))).reshape(x.shape)


@pytest.mark.parametrize("build", ["native", "haswell"])
@pytest.mark.parametrize(("bits", "symmetric"), FORMATS)
def test_tiled_rows_are_the_one_row_results(libs, build: str, bits: int, symmetric: bool) -> None:
    lib = libs[build]
    g = torch.Generator().manual_seed(bits)
    qw = quantize(torch.randn(N, K, generator=g), bits, 32, symmetric)
    dense = reference_dequantize(qw).double()
    x64 = torch.randn(cpu_qgemv.KERNEL_MAX_ROWS, K, generator=g) * 3
    x64[5, 64:96] = 0.0  # an all-zero block of x: scale 0
    for dtype, x_bits in PATHS:
        bias = torch.randn(N, generator=g).to(dtype)
        args = (qw.qweight, qw.scales, qw.offsets, bias, bits, 32, N)
        for rows in (9, 23, cpu_qgemv.KERNEL_MAX_ROWS):
            x = x64[:rows].to(dtype)
            tiled = cpu_qgemv.qgemv(lib, x, *args, x_bits=x_bits)
            one_by_one = torch.cat([cpu_qgemv.qgemv(lib, x[i : i + 1], *args, x_bits=x_bits)
                                    for i in range(rows)])  # fmt: skip
            assert torch.equal(tiled, one_by_one), (dtype, x_bits, rows)
            used = _int8_rounded(x) if x_bits == 8 else x
            expected = used.double() @ dense.T + bias.double()
            magnitude = used.double().abs() @ dense.abs().T
            # float32 sums (int16 x: 1/65534 of a group's largest value), one rounding of y
            rel = 2**-8 if dtype == torch.bfloat16 else 1e-6
            allowed = expected.abs() * rel + magnitude * (4e-5 if x_bits == 16 else 1e-5) + 1e-5
            assert ((tiled.double() - expected).abs() <= allowed).all(), (dtype, x_bits, rows)


def test_more_rows_than_one_call_takes_is_refused(libs) -> None:
    qw = quantize(torch.randn(N, K), 8, 32, True)
    x = torch.randn(cpu_qgemv.KERNEL_MAX_ROWS + 1, K)
    with pytest.raises(RuntimeError, match="failed"):
        cpu_qgemv.qgemv(libs["native"], x, qw.qweight, qw.scales, None, None, 8, 32, N, x_bits=8)


def test_row_counts_the_kernel_takes(libs, monkeypatch: pytest.MonkeyPatch) -> None:
    """`QuantizedWeight.linear` sends up to KERNEL_MAX_ROWS rows to one kernel call; on the int8
    path (a GGUF file's layers) more rows go in chunks of that size up to the measured limit of
    the weight's bits; beyond, torch's matmul over the rebuilt dense weight."""
    calls = []
    stored_dense = weight_only.QuantizedWeight._stored_dense
    monkeypatch.setattr(weight_only.QuantizedWeight, "_stored_dense", lambda self, dtype:
                        calls.append(dtype) or stored_dense(self, dtype))  # fmt: skip
    limit = weight_only.KERNEL_MAX_ROWS[4]
    chunk = cpu_qgemv.KERNEL_MAX_ROWS
    qw = quantize(torch.randn(N, K), 4, 32, True)
    x = torch.randn(limit + 1, K)
    args = (qw.qweight, qw.scales, None, None, 4, 32, N)
    exact = cpu_qgemv.qgemv(libs["native"], x[:48], *args, x_bits=32)
    assert torch.equal(qw.linear(x[:48], None), exact) and calls == []
    assert qw.linear(x[: chunk + 1], None).shape == (chunk + 1, N)  # exact path: dense above
    assert calls == [torch.float32]
    qw.gguf_file = True  # float32 x as int8
    rows = 2 * chunk + 5
    out = qw.linear(x[:rows], None)
    assert calls == [torch.float32]
    whole = [cpu_qgemv.qgemv(libs["native"], x[i : i + 1], *args, x_bits=8) for i in range(rows)]
    assert torch.equal(out, torch.cat(whole))
    dense = qw.linear(x, None)
    assert calls == [torch.float32] * 2
    torch.testing.assert_close(dense, x @ reference_dequantize(qw).T, rtol=1e-4, atol=1e-4)
