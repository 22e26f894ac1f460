"""Linear weights prepacked for oneDNN on CPU: same results, used by the engine, refused when
they would not fit or would not help."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from tests.engine._fixtures import LLAMA, NUM_BLOCKS, checkpoint, hf_greedy, mixed_prompts
from tokenwise import LLM, SamplingParams
from tokenwise.layers import cpu_prepack
from tokenwise.layers.cpu_prepack import linear, prepack_linear_weights
from tokenwise.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tokenwise.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from tokenwise.native import gemv as cpu_gemv

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN"
)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    embed = VocabParallelEmbedding(50, 32)
    model = torch.nn.ModuleDict(
        {
            "embed": embed,
            "qkv": QKVParallelLinear(32, 8, 4, 2, bias=True),
            "o": RowParallelLinear(32, 32),
            "plain": ReplicatedLinear(32, 16, bias=True),
            "head": ParallelLMHead(50, 32, tie_to=embed),
        }
    )
    for param in model.parameters():
        param.data.normal_()
    return model


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_packed_linear_equals_f_linear(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight)
    x = torch.randn(rows, 128, generator=gen)[:, ::2]  # a strided input, as slices give
    torch.testing.assert_close(linear(x, weight, bias, packed), F.linear(x, weight, bias))
    torch.testing.assert_close(linear(x, weight, None, packed), F.linear(x, weight))


def test_every_linear_layer_and_the_tied_head_are_packed_and_used() -> None:
    model = _model()
    # More rows than the small-M kernel takes (that one reads the plain weight).
    x = torch.randn(max(cpu_gemv.max_rows(d) for d in cpu_gemv.DTYPES) + 5, 32)
    before = {name: layer(x) for name, layer in model.items() if name != "embed"}
    assert prepack_linear_weights(model) == 4
    # The forward must go through the packed copy: scrambling the plain weights (the tied
    # embedding included; biases are not packed) changes nothing.
    for name, param in model.named_parameters():
        if name.endswith("weight"):
            param.data.mul_(-3.0)
    for name, out in before.items():
        torch.testing.assert_close(model[name](x), out, msg=name)


def test_switched_off_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENWISE_CPU_PREPACK", "0")
    model = _model()
    assert prepack_linear_weights(model) == 0
    assert all(getattr(m, "packed_weight", None) is None for m in model.modules())


def test_not_packed_when_the_copies_would_crowd_memory(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("TOKENWISE_CPU_PREPACK", raising=False)
    monkeypatch.setattr(cpu_prepack, "_available_bytes", lambda: 4096)
    with caplog.at_level(logging.INFO, logger="tokenwise.layers.cpu_prepack"):
        assert prepack_linear_weights(_model()) == 0
    assert "TOKENWISE_CPU_PREPACK=1" in caplog.text
    monkeypatch.setenv("TOKENWISE_CPU_PREPACK", "1")  # forced: packed regardless
    assert prepack_linear_weights(_model()) == 4


@pytest.mark.parametrize("has_bf16", [True, False], ids=["onednn-bf16", "no-bf16-kernels"])
def test_bf16_layers_compute_bf16_results(monkeypatch: pytest.MonkeyPatch, has_bf16: bool) -> None:
    """Where oneDNN has no bf16 kernels, a bf16 weight is packed widened to float32; either
    way the layer returns what a bf16 matmul returns (fp32 products and sums, bf16 output)."""
    if has_bf16 and not cpu_prepack.onednn_has_bf16():
        pytest.skip("oneDNN has no bf16 kernels on this CPU")
    monkeypatch.setattr(cpu_prepack, "onednn_has_bf16", lambda: has_bf16)
    model = _model().to(torch.bfloat16)
    x = torch.randn(9, 32).to(torch.bfloat16)
    expected = {
        name: F.linear(x.float(), layer.weight.float(), None).to(torch.bfloat16)
        for name, layer in model.items()
        if name in ("o", "head")  # no bias: the rounding point is the same on both sides
    }
    assert prepack_linear_weights(model) == 4
    want = torch.bfloat16 if has_bf16 else torch.float32
    assert {m.packed_weight.dtype for m in model.values() if hasattr(m, "packed_weight")} == {want}
    torch.testing.assert_close(model["o"](x), expected["o"])
    torch.testing.assert_close(model["head"](x), expected["head"].float())


def test_engine_packs_its_linears_and_still_equals_hf() -> None:
    path = checkpoint(LLAMA, tie_word_embeddings=True)
    llm = LLM(path, dtype="float32", num_gpu_blocks=NUM_BLOCKS)
    model = llm.llm_engine.runner.model
    packable = [m for m in model.modules() if hasattr(m, "packed_weight")]
    assert packable and all(m.packed_weight is not None for m in packable)
    prompts = mixed_prompts()[:6]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, 8)
