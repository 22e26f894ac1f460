"""int4 / int8 layers off the CPU (`gpu_int4`, `gpu_weight_only`, `gpu_selfcheck`), on the CPU.

CI has no GPU. torch's tinygemm has CPU twins (`_convert_weight_to_int4pack_for_cpu`,
`_weight_int4pack_mm_for_cpu`) computing the same `(q - 8) * scale + zero` from the same
`scales_and_zeros`, so the conversion of tokenwise's scales and offsets, the group layout and
the self-check's selection logic run here with the twins standing in for the CUDA ops. What
stays unverified here is the CUDA uint8 nibble order (`gpu_int4._cuda_pack`): the load-time
self-check covers it on the device, and tests/test_gpu_path.py checks it on a GPU.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tokenwise.layers.quantization import gpu_int4, gpu_selfcheck, gpu_weight_only
from tokenwise.layers.quantization.prequantized import integer_weight
from tokenwise.layers.quantization.weight_only import (
    QuantizedWeight,
    quantize,
    reference_dequantize,
)
from tokenwise.quantization_config import keeps_integers, resolve_quantization, uses_cpu_kernels

TWIN = gpu_int4.CPU_TWIN_OPS


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)


def _gptq_like(n: int, k: int, group: int, seed: int = 0) -> QuantizedWeight:
    """A GPTQ / AWQ-style record: integers 0..15, zero points 0..15, float16 scales; its
    offsets `-z * s` are float32 where float16 does not hold them (`integer_weight`)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    zeros = torch.randint(0, 16, (n, k // group), generator=g, dtype=torch.int32)
    scales = (torch.rand(n, k // group, generator=g) * 0.05 + 1e-3).half()
    groups = torch.arange(k) // group
    record = integer_weight("layer", q, zeros, scales, 4, groups, signed=False)
    assert record is not None and record.offsets is not None
    return record


def _relative_error(ours: torch.Tensor, expected: torch.Tensor) -> float:
    return float((ours.float() - expected).norm() / expected.norm())


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("kind", ["symmetric", "asymmetric", "gptq"])
def test_tinygemm_layout_computes_the_definition(group: int, kind: str) -> None:
    """Packed with the twin, tinygemm's product equals `x @ reference_dequantize(w)^T` within
    bfloat16 (scales, zeros and output rounded to bf16: relative 2^-9 each)."""
    n, k = 48, 256
    if kind == "gptq":
        weight = _gptq_like(n, k, group)
    else:
        weight = quantize(_weight(n, k), 4, group, symmetric=kind == "symmetric")
    values = gpu_weight_only.int4_values(weight.qweight)
    kernel = gpu_int4.pack(values, weight.scales, weight.offsets, group, TWIN)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(1)).bfloat16()
    expected = x.float() @ reference_dequantize(weight).t()
    assert _relative_error(kernel.mm(x), expected) < 5e-3
    assert gpu_selfcheck.self_check(weight, kernel) is None


def test_scales_and_zeros_layout() -> None:
    """`[K / group, N, 2]`: (s, o + 8 s) of each row's group; symmetric int4's zero is 0."""
    scales = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]).half()
    offsets = torch.tensor([[-1.0, 0.5], [0.0, -2.0], [1.0, 1.0]]).half()
    sz = gpu_int4.scales_and_zeros(scales, offsets, torch.float32)
    assert sz.shape == (2, 3, 2)
    assert sz[1, 0].tolist() == [2.0, 0.5 + 16.0]
    assert sz[0, 2].tolist() == [5.0, 1.0 + 40.0]
    assert not gpu_int4.scales_and_zeros(scales, None, torch.float32)[..., 1].any()


def test_formats_the_kernel_cannot_take_are_named() -> None:
    assert gpu_int4.unfit_reason(4, 64, (96, 256)) is None
    assert "int8" in gpu_int4.unfit_reason(8, 32, (96, 256))
    assert "groups of 16" in gpu_int4.unfit_reason(4, 16, (96, 256))
    assert "output rows" in gpu_int4.unfit_reason(4, 32, (100, 256))
    assert gpu_int4.inner_k_tiles(256) == 8 and gpu_int4.inner_k_tiles(96) == 2


def _swapped_pack(values: torch.Tensor, inner: int) -> torch.Tensor:
    """A packing that gets the nibble order wrong: each pair of values swapped."""
    n, k = values.shape
    return TWIN.pack(values.reshape(n, k // 2, 2).flip(-1).reshape(n, k), inner)


class _Counting:
    def __init__(self, ops: gpu_int4.Int4Ops) -> None:
        self.calls, self.ops = 0, ops

    def mm(self, *args: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.ops.mm(*args)


def test_selfcheck_takes_a_right_packing_once_per_format() -> None:
    """A correct packing passes, the layer drops its own integers (the kernel holds them),
    still computes the definition, reads its dense weight back, and a second layer of the
    same format is not checked again."""
    counter = _Counting(TWIN)
    ops = dataclasses.replace(TWIN, mm=counter.mm)
    verdicts: dict = {}
    weights = [quantize(_weight(64, 128, seed), 4, 64, symmetric=False) for seed in (0, 1)]
    references = [reference_dequantize(w) for w in weights]
    assert all(gpu_selfcheck.choose("l", w, ops, verdicts) for w in weights)
    assert counter.calls == 1 and list(verdicts.values()) == [None]
    x = torch.randn(3, 128).bfloat16()
    for weight, reference in zip(weights, references, strict=True):
        assert weight.qweight.numel() == 0 and weight.device_kernel.owns_integers
        assert (
            _relative_error(gpu_weight_only.linear(weight, x, None), x.float() @ reference.t())
            < 5e-3
        )
        dense = gpu_weight_only.dequantize_stored(weight, torch.float32)
        assert _relative_error(dense, reference) < 5e-3
    # float16 activations take the kernel too (rounded to bf16), in and out in float16
    half = gpu_weight_only.linear(weights[0], x.half(), None)
    assert half.dtype == torch.float16
    assert _relative_error(half, x.float() @ references[0].t()) < 5e-3
    assert gpu_weight_only.linear(weights[0], x[:0], None).shape == (0, 64)
    # the check; a product and a read-back per layer; float16; the empty call reads back
    assert counter.calls == 1 + 2 * 2 + 1 + 1


@pytest.mark.parametrize("fault", ["swapped nibbles", "raises", "packing raises"])
def test_selfcheck_falls_back_where_the_kernel_is_wrong(
    fault: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A wrong packing (or a kernel that raises) is caught at load, logged once naming the
    layer, and the layer is dequantized per call: its output equals the definition."""

    def refuse(*args: object) -> torch.Tensor:
        raise RuntimeError("no kernel image is available")

    if fault == "raises":
        ops = dataclasses.replace(TWIN, mm=refuse)
    elif fault == "packing raises":
        ops = dataclasses.replace(TWIN, pack=refuse)
    else:
        ops = dataclasses.replace(TWIN, pack=_swapped_pack)
    weight = quantize(_weight(32, 256), 4, 32, symmetric=True)
    other = quantize(_weight(32, 256, seed=3), 4, 32, symmetric=True)
    verdicts: dict = {}
    caplog.set_level(logging.WARNING, logger="tokenwise")
    assert not gpu_selfcheck.choose("model.layers.0.mlp.down_proj", weight, ops, verdicts)
    assert not gpu_selfcheck.choose("model.layers.1.mlp.down_proj", other, ops, verdicts)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "model.layers.0.mlp.down_proj" in warnings[0]
    assert ("read back wrong" if fault == "swapped nibbles" else "no kernel image") in warnings[0]
    assert weight.device_kernel is None and weight.qweight.numel() == 32 * 128
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(2))
    expected = F.linear(x, reference_dequantize(weight))
    torch.testing.assert_close(gpu_weight_only.linear(weight, x, None), expected)


@pytest.mark.parametrize(("bits", "symmetric"), [(8, True), (8, False), (4, True), (4, False)])
def test_per_call_dequantization_equals_the_definition(bits: int, symmetric: bool) -> None:
    """The fallback (and int8's route): torch ops give the definition's values exactly."""
    weight = quantize(_weight(36, 128), bits, 32, symmetric)
    expected = reference_dequantize(weight)
    assert torch.equal(gpu_weight_only.dequantize_stored(weight, torch.float32), expected)
    assert gpu_int4.unfit_reason(bits, 32, (36, 128)) is not None  # 36 rows: not tinygemm's
    x, bias = torch.randn(3, 128), torch.randn(36)
    torch.testing.assert_close(gpu_weight_only.linear(weight, x, bias), F.linear(x, expected, bias))


class _Holder(nn.Module):
    def __init__(self, attr: str, held: object) -> None:
        super().__init__()
        setattr(self, attr, held)


def test_prepare_model_keeps_a_tied_embeddings_integers() -> None:
    """A weight shared by the embedding (rows read its integers) and the LM head keeps its
    integers beside the kernel; an embedding-only table gets no kernel; int8 is dequantized."""
    tied = quantize(_weight(64, 128), 4, 64, symmetric=False)
    table = quantize(_weight(64, 128, 1), 4, 64, symmetric=False)
    int8 = quantize(_weight(64, 128, 2), 8, 32)
    model = nn.Sequential(
        _Holder("quant_table", tied), _Holder("quant_weight", tied),
        _Holder("quant_table", table), _Holder("quant_weight", int8),
    )  # fmt: skip
    routes = gpu_selfcheck.prepare_model(model, torch.device("cpu"), torch.float32, TWIN)
    assert routes == {"kernel": 0, "dequantize": 2}  # float32 activations: no kernel
    routes = gpu_selfcheck.prepare_model(model, torch.device("cpu"), torch.bfloat16, TWIN)
    assert routes == {"kernel": 1, "dequantize": 1}
    assert tied.device_kernel is not None and tied.qweight.numel() == 64 * 64
    assert table.device_kernel is None and int8.device_kernel is None


def test_loading_decisions_keep_integers_on_cuda() -> None:
    """On a CUDA device int8 / int4 load quantized and GGUF / GPTQ / AWQ / compressed-tensors
    keep their integers (no dequantization at load); other devices keep the old behaviour."""
    for method in ("int4", "int8", "gguf", "gptq", "awq", "compressed-tensors"):
        assert keeps_integers(method, "cuda") and keeps_integers(method, "cuda:1")
        assert keeps_integers(method, "cpu") and not keeps_integers(method, "mps")
        assert not uses_cpu_kernels(method, "cuda")  # torch.compile may trace the GPU route
    assert not keeps_integers(None, "cuda") and not keeps_integers("fp8", "cuda")
    assert resolve_quantization("int4", None, "auto", "cuda:0") == "int4"
    with pytest.raises(ValueError, match="quantization='int8' runs on CPU and CUDA"):
        resolve_quantization("int8", None, "auto", "mps")


@pytest.mark.parametrize("bits", [4, 8])
def test_gpu_route_traces_in_one_graph(bits: int) -> None:
    """On a GPU the engine compiles the model (CUDA graphs): both routes trace in one graph
    with a dynamic row count (no graph break, no recompilation per row count), the twin
    standing in for the CUDA kernel, and the compiled product still equals the definition."""
    weight = quantize(_weight(64, 128), bits, 64 if bits == 4 else 32, symmetric=False)
    reference = reference_dequantize(weight)
    assert gpu_selfcheck.choose("l", weight, TWIN, {}) == (bits == 4)
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda x: gpu_weight_only.linear(weight, x, None),
        backend="aot_eager",
        fullgraph=True,
        dynamic=True,
    )
    for rows in (3, 9):
        x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)).bfloat16()
        assert _relative_error(compiled(x), x.float() @ reference.t()) < 5e-3


@pytest.mark.parametrize(("bits", "symmetric"), [(8, True), (4, True), (4, False)])
def test_embedding_rows_on_the_device_trace_and_equal_the_definition(
    bits: int, symmetric: bool
) -> None:
    """A quantized embedding's lookup off the CPU (torch ops): the definition's rows, traced
    in one graph as the compiled model needs."""
    weight = quantize(_weight(50, 64), bits, 32, symmetric)
    ids = torch.tensor([[3, 0, 49], [7, 7, 1]])
    expected = reference_dequantize(weight)[ids]
    assert torch.equal(gpu_weight_only.rows(weight, ids, torch.float32), expected)
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda i: gpu_weight_only.rows(weight, i, torch.bfloat16),
        backend="aot_eager",
        fullgraph=True,
        dynamic=True,
    )
    assert torch.equal(compiled(ids), expected.bfloat16())
