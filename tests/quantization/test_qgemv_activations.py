"""bfloat16 activations in the quantized CPU kernel: int8 per 32 values (llama.cpp's arithmetic,
the default) or int16 per group, on every vector path this CPU can build; float32 activations
exact, or int8 when asked.

The int8 path must compute exactly the dot product of the dequantized weights with x rounded
to int8 per block of 32 (scale max|x| / 127, round half to even): that reference is written
here from the definition with torch ops, so only float summation order and the final bf16
rounding separate it from the kernel.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

from tokenwise.layers.quantization.weight_only import quantize, reference_dequantize, stack_rows
from tokenwise.native import build as native_build
from tokenwise.native import qgemv as cpu_qgemv

FORMATS = [(8, True), (8, False), (4, True), (4, False)]
# The narrower builds a CPU with fewer extensions gets: no VNNI (byte products through
# vpmaddubsw, int8 weights by the sign trick), AVX2 with AVX-VNNI, plain AVX2.
VARIANTS = {
    "native": [],
    "avx512-no-vnni": ["-mno-avx512vnni", "-mno-avxvnni"],
    "avx2-vnni": ["-mno-avx512f"],
    "avx2": ["-mno-avx512f", "-mno-avxvnni", "-mno-avx512vnni"],
}
EXPECTED_ISA = {"avx512-no-vnni": 2, "avx2-vnni": 1, "avx2": 1}


@pytest.fixture(scope="module")
def native():
    lib = cpu_qgemv.load()
    if lib is None or lib.tw_qgemv_isa() == 0:
        pytest.skip("no vector build of the quantized kernel here (no compiler, AVX2 or libgomp)")
    return lib


@pytest.fixture(scope="module", params=list(VARIANTS))
def lib(request, native):
    if request.param == "native":
        return native
    flags = [*cpu_qgemv.flags(), *VARIANTS[request.param]]
    path = native_build.build(native_build.find_compiler(), cpu_qgemv.KERNEL.source, "qgemv", flags)
    variant = cpu_qgemv.open_library(path)
    if variant.tw_qgemv_isa() != EXPECTED_ISA[request.param]:
        pytest.skip(f"this CPU has no {request.param} path")
    return variant


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) + 0.01


def _x(rows: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g) * 4
    x[0, 5] = 0.0
    if k >= 64:
        x[:, 32:64] = 0.0  # an all-zero block: scale 0
    return x.to(torch.bfloat16)


def _int8_rounded(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel sees it on the int8 path: per 32 values, round(x * 127 / max|x|) * scale."""
    rows, k = x.shape
    blocks = x.float().reshape(rows, k // 32, 32)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    # full_like: torch computes `scalar / tensor` through a reciprocal, not rounded as C does
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inv)  # half to even, as the kernel's lrintf
    assert q.abs().max() <= 127
    return (q * (amax / torch.full_like(amax, 127.0))).reshape(rows, k)


def _close_to(out: torch.Tensor, x_used: torch.Tensor, dense: torch.Tensor, bias) -> None:
    expected = x_used.double() @ dense.double().T + (0 if bias is None else bias.double())
    magnitude = x_used.double().abs() @ dense.double().abs().T
    # float32 summation over K terms, then one bf16 rounding of the result.
    allowed = expected.abs() * 2**-8 + magnitude * 1e-5 + 1e-6
    assert out.dtype == torch.bfloat16
    assert ((out.double() - expected).abs() <= allowed).all()


@pytest.mark.parametrize(("bits", "symmetric"), FORMATS)
@pytest.mark.parametrize(("k", "group"), [(256, 32), (640, 64), (768, 128), (512, 256)])
def test_int8_path_is_the_product_with_int8_rounded_x(
    lib, bits: int, symmetric: bool, k: int, group: int
) -> None:
    """K 640 and 768 end in a part-filled chunk of blocks; groups of 64-256 spread one scale
    over several blocks of x. 67 weight rows: blocks of 4 rows, then single ones."""
    qw = quantize(_weight(67, k, seed=k + bits), bits, group, symmetric)
    dense = reference_dequantize(qw)
    bias = torch.randn(67).to(torch.bfloat16)
    for rows in (1, 2, 3, 5, 8):
        x = _x(rows, k, seed=rows)
        for b in (None, bias):
            args = (qw.qweight, qw.scales, qw.offsets, b, bits, group, 67)
            out = cpu_qgemv.qgemv(lib, x, *args, x_bits=8)
            _close_to(out, _int8_rounded(x), dense, None if b is None else b.float())


@pytest.mark.parametrize(("bits", "symmetric"), FORMATS)
def test_int8_path_error_is_what_int8_x_allows(lib, bits: int, symmetric: bool) -> None:
    """Against the exact float product the int8 path is off by x's rounding (half a step of
    max|x| / 127 per block) and no more; the int16 path by 1/256 of that."""
    qw = quantize(_weight(40, 512, seed=3), bits, 32, symmetric)
    dense = reference_dequantize(qw).double()
    x = _x(4, 512, seed=9)
    exact = x.double() @ dense.T
    step = x.float().reshape(4, 16, 32).abs().amax(-1, keepdim=True).expand(4, 16, 32) / 127
    x_err = (step.reshape(4, 512).double() / 2) @ dense.abs().T
    for x_bits, scale in ((8, 1.0), (16, 1 / 256)):
        args = (qw.qweight, qw.scales, qw.offsets, None, bits, 32, 40)
        out = cpu_qgemv.qgemv(lib, x, *args, x_bits=x_bits).double()
        allowed = exact.abs() * 2**-8 + x_err * scale + 1e-5
        assert ((out - exact).abs() <= allowed).all()
    # and the int8 path really is coarser: its error exceeds the int16 bound somewhere.
    out8 = cpu_qgemv.qgemv(lib, x, *args, x_bits=8).double()
    assert ((out8 - exact).abs() > exact.abs() * 2**-8 + x_err / 256 + 1e-5).any()


@pytest.mark.parametrize(("bits", "k"), [(4, 96), (8, 48)])
def test_shapes_the_int8_path_cannot_take_keep_int16(lib, bits: int, k: int) -> None:
    """int4 rows that are not whole 128-value steps (64 on AVX2), and int8 groups of 16, go to
    the int16 path even when int8 is asked for: int16's error bound holds."""
    group = 32 if bits == 4 else 16
    qw = quantize(_weight(20, k, seed=1), bits, group, True)
    dense = reference_dequantize(qw)
    x = _x(3, k, seed=2)
    args = (qw.qweight, qw.scales, qw.offsets, None, bits, group, 20)
    out8 = cpu_qgemv.qgemv(lib, x, *args, x_bits=8)
    out16 = cpu_qgemv.qgemv(lib, x, *args, x_bits=16)
    assert torch.equal(out8, out16)
    _close_to(out8, x.float(), dense, None)


def test_float32_x_stays_exact_by_default(native, monkeypatch: pytest.MonkeyPatch) -> None:
    """Unless TOKENWISE_CPU_QUANT_FP32_ACTIVATIONS says int8, float32 x is not rounded (and
    16 bits, a bf16-only path, leaves it exact too)."""
    monkeypatch.delenv(cpu_qgemv.FP32_ACTIVATIONS_ENV, raising=False)
    cpu_qgemv.fp32_activation_bits.cache_clear()
    qw = quantize(_weight(33, 256, seed=4), 4, 32, True)
    x = _x(2, 256, seed=5).float()
    args = (qw.qweight, qw.scales, None, None, 4, 32, 33)
    try:
        for x_bits in (None, 16, 32):
            out = cpu_qgemv.qgemv(native, x, *args, x_bits=x_bits)
            torch.testing.assert_close(out, x @ reference_dequantize(qw).T, rtol=1e-5, atol=1e-5)
    finally:
        cpu_qgemv.fp32_activation_bits.cache_clear()


@pytest.mark.parametrize(("bits", "symmetric"), FORMATS)
def test_float32_x_on_the_int8_path(lib, bits: int, symmetric: bool) -> None:
    """float32 x with 8 bits asked for (TOKENWISE_CPU_QUANT_FP32_ACTIVATIONS=int8) is the
    product with x rounded to int8 per 32 values, as for bf16 x, and the output stays float32:
    only float summation order separates it from the reference. K 640 ends in a part-filled
    chunk; 3 and 8 rows of x, 19 weight rows (not a multiple of any block height)."""
    qw = quantize(_weight(19, 640, seed=bits), bits, 64, symmetric)
    dense = reference_dequantize(qw).double()
    for rows in (1, 3, 8):
        x = _x(rows, 640, seed=rows).float()
        x[:, 100] = 1000.0 * (rows - 2)  # a block whose largest value dwarfs the others
        args = (qw.qweight, qw.scales, qw.offsets, None, bits, 64, 19)
        out = cpu_qgemv.qgemv(lib, x, *args, x_bits=8)
        assert out.dtype == torch.float32
        expected = _int8_rounded(x).double() @ dense.T
        magnitude = x.double().abs() @ dense.abs().T
        assert ((out.double() - expected).abs() <= magnitude * 1e-5 + 1e-6).all()
        # and it is not the exact product: the block with the outlier lost its small values
        assert not torch.allclose(out.double(), x.double() @ dense.T, rtol=1e-5, atol=1e-5)


SETTINGS = [  # variable, its reader, value (None: unset) -> (what the reader returns, the bits
    # x gets before a layer tokenwise quantized, before a GGUF file's layer), a bad value and
    # its message
    ("TOKENWISE_CPU_QUANT_ACTIVATIONS", "activation_bits",
     {None: (8, 8, 8), "int16": (16, 16, 16)}, "fp8",
     "TOKENWISE_CPU_QUANT_ACTIVATIONS.*int8, int16"),
    ("TOKENWISE_CPU_QUANT_FP32_ACTIVATIONS", "fp32_activation_bits",
     {None: (None, 32, 8), "float": (32, 32, 32), " INT8 ": (8, 8, 8)},
     "int16", "QUANT_FP32_ACTIVATIONS must be one of auto, float, int8"),
]  # fmt: skip


@pytest.mark.parametrize(("env", "reader", "values", "bad", "message"), SETTINGS)
def test_activation_settings(
    monkeypatch: pytest.MonkeyPatch, env: str, reader: str, values: dict, bad: str, message: str
) -> None:
    read = getattr(cpu_qgemv, reader)
    dtype = torch.float32 if "FP32" in env else torch.bfloat16
    try:
        for value, bits in values.items():
            read.cache_clear()
            if value is None:
                monkeypatch.delenv(env, raising=False)
            else:
                monkeypatch.setenv(env, value)
            got = (read(), cpu_qgemv.default_x_bits(dtype), cpu_qgemv.default_x_bits(dtype, True))
            assert got == bits
        read.cache_clear()
        monkeypatch.setenv(env, bad)
        with pytest.raises(ValueError, match=message):
            read()
    finally:
        read.cache_clear()


def test_haswell_build_matches_native(native, haswell_qgemv) -> None:
    """TOKENWISE_CPU_MARCH=haswell builds the AVX2+FMA kernel (no 512-bit register in its code)
    and it computes what the native build does on every path (float32 x exact and int8, bf16 x
    int8), up to float summation order."""
    path, cache = haswell_qgemv
    assert path.parent == cache
    if shutil.which("objdump"):
        code = subprocess.run(["objdump", "-d", str(path)], capture_output=True, text=True).stdout
        assert "vfmadd" in code and "zmm" not in code
    haswell = cpu_qgemv.open_library(path)
    assert haswell.tw_qgemv_isa() == 1
    for bits, symmetric in FORMATS:
        qw = quantize(_weight(21, 512, seed=bits), bits, 32, symmetric)
        dense = reference_dequantize(qw).double()
        args = (qw.qweight, qw.scales, qw.offsets, None, bits, 32, 21)
        for rows in (1, 6):
            x = _x(rows, 512, seed=rows)
            for dtype, x_bits in ((torch.float32, 32), (torch.float32, 8), (torch.bfloat16, 8)):
                xd = x.to(dtype)
                a = cpu_qgemv.qgemv(native, xd, *args, x_bits=x_bits).double()
                b = cpu_qgemv.qgemv(haswell, xd, *args, x_bits=x_bits).double()
                magnitude = xd.double().abs() @ dense.abs().T
                # bf16 output: the two may round a result to neighbouring bf16 values
                rel = 2**-7 if dtype == torch.bfloat16 else 0.0
                assert ((a - b).abs() <= a.abs() * rel + magnitude * 1e-5 + 1e-6).all()


def test_gguf_blocks_default_to_int8_float32_activations(
    native, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under the default ("auto") a layer holding a GGUF file's blocks multiplies float32 x as
    int8 per 32 values, as llama.cpp does; a layer quantized by tokenwise keeps the exact
    product; "float" and "int8" hold for both kinds. Rows fused from GGUF parts stay GGUF."""
    monkeypatch.delenv(cpu_qgemv.FP32_ACTIVATIONS_ENV, raising=False)
    cpu_qgemv.fp32_activation_bits.cache_clear()
    qw = quantize(_weight(33, 256, seed=6), 8, 32, True)
    x = _x(2, 256, seed=7).float()
    exact = x @ reference_dequantize(qw).T
    args = (qw.qweight, qw.scales, None, None, 8, 32, 33)
    as_int8 = cpu_qgemv.qgemv(native, x, *args, x_bits=8)
    assert (as_int8 - exact).abs().max() > 1e-4  # the rounding shows: the check can tell
    try:
        torch.testing.assert_close(qw.linear(x, None), exact, rtol=1e-5, atol=1e-5)
        from_file = stack_rows([qw, qw])
        assert not from_file.gguf_file
        qw.gguf_file = True
        assert torch.equal(qw.linear(x, None), as_int8)
        assert stack_rows([qw, qw]).gguf_file
        monkeypatch.setenv(cpu_qgemv.FP32_ACTIVATIONS_ENV, "float")
        cpu_qgemv.fp32_activation_bits.cache_clear()
        torch.testing.assert_close(qw.linear(x, None), exact, rtol=1e-5, atol=1e-5)
        monkeypatch.setenv(cpu_qgemv.FP32_ACTIVATIONS_ENV, "int8")
        cpu_qgemv.fp32_activation_bits.cache_clear()
        qw.gguf_file = False
        assert torch.equal(qw.linear(x, None), as_int8)
        monkeypatch.setenv(cpu_qgemv.FP32_ACTIVATIONS_ENV, "int4")
        cpu_qgemv.fp32_activation_bits.cache_clear()
        with pytest.raises(ValueError, match="QUANT_FP32_ACTIVATIONS must be one of auto"):
            cpu_qgemv.fp32_activation_bits()
    finally:
        cpu_qgemv.fp32_activation_bits.cache_clear()
