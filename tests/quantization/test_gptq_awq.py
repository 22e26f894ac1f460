"""GPTQ and AWQ checkpoints load into tokenwise and compute what their integers say.

The checkpoints are made here from a tiny float Llama, quantized by hand (round-to-nearest per
group, which is all a checkpoint's layout records) and packed following each published layout
independently of the loader: GPTQ (`qweight` packed along K, `qzeros` along N, v1's stored
zero minus one, `g_idx` with act-order) and AWQ GEMM (packed along N in the interleaved order
0 2 4 6 1 3 5 7). Reference: transformers loading a float checkpoint whose linear weights are
the hand-dequantized `(q - z) * s` in float32. tokenwise holds exactly those weights (its
records give `q * s + o` with `o = -z * s`, equal in float32), so the only difference left is
fp32 kernel order: the repo's HF parity bar, 1e-4 on logits, and the same greedy tokens on
every prompt, apply unchanged.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.engine._fixtures import hf_greedy, hf_model, mixed_prompts
from tests.tiny_checkpoints import build_tiny_checkpoint
from tokenwise import LLM, SamplingParams
from tokenwise.config import EngineConfig
from tokenwise.layers.quantization.weight_only import QuantizedWeight, unpack_int4
from tokenwise.loader import load_model
from tokenwise.model_config import ModelConfig

SHAPE = {"hidden_size": 64, "intermediate_size": 128}
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GROUP = 32
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
MAX_TOKENS = 8
ATOL = 1e-4  # fp32 kernel order only (see the module docstring)


def _groups(name: str, k: int, act_order: bool, group: int = GROUP) -> torch.Tensor:
    """Each input column's group. Act-order: one random permutation per layer input (q, k and
    v read the same input, as do gate and up, so GPTQ gives them the same order)."""
    if not act_order:
        return torch.arange(k) // group
    layer = name.split(".")[2]
    source = "qkv" if name.split(".")[-2] in ("q_proj", "k_proj", "v_proj") else name
    source = "gate_up" if name.split(".")[-2] in ("gate_proj", "up_proj") else source
    seed = zlib.crc32(f"{layer}.{source}".encode())
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    groups = torch.empty(k, dtype=torch.int64)
    groups[perm] = torch.arange(k) // group  # GPTQ's g_idx[perm[i]] = i // G
    return groups


def _quantize(
    w: torch.Tensor, groups: torch.Tensor, sym: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round to nearest per group: integers q [N, K] in 0..15, zeros z and float16 scales s
    [N, groups]."""
    n = w.shape[0]
    count = int(groups.max()) + 1
    s = torch.empty(n, count)
    z = torch.empty(n, count, dtype=torch.int64)
    for g in range(count):
        part = w[:, groups == g]
        if sym:
            s[:, g] = (part.abs().amax(1) * 2 / 15).half().float()
            z[:, g] = 8
        else:
            low, high = part.amin(1).clamp(max=0), part.amax(1).clamp(min=0)
            s[:, g] = ((high - low) / 15).half().float()
            z[:, g] = torch.round(-low / s[:, g]).clamp(0, 15).long()
    q = (torch.round(w / s[:, groups]) + z[:, groups]).clamp(0, 15).long()
    return q, z, s.half()


def _pack(values: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """int values [R, C] in 0..15 -> int32 [R, C / 8], word c's field p holding column
    8c + order[p] (the low bits first)."""
    r, c = values.shape
    words = torch.zeros(r, c // 8, dtype=torch.int64)
    for p, column in enumerate(order):
        words |= (values[:, column::8].long() & 15) << (4 * p)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _write(path: str, state: dict[str, torch.Tensor], quantization_config: Any = None) -> None:
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    if quantization_config is not None:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        config["quantization_config"] = quantization_config
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f)


def _checkpoints(
    tmp_path: Any,
    method: str,
    sym: bool = False,
    act_order: bool = False,
    fmt: str = "gptq",
    group: int = GROUP,
) -> tuple[str, str, dict[str, Any]]:
    """(quantized checkpoint, float reference checkpoint, per-layer integers)."""
    dense = build_tiny_checkpoint(tmp_path, "LlamaForCausalLM", **SHAPE)
    quantized, reference = str(tmp_path / method), str(tmp_path / "reference")
    shutil.copytree(dense, quantized)
    shutil.copytree(dense, reference)
    state = load_file(os.path.join(dense, "model.safetensors"))
    packed, exact, layers = {}, {}, {}
    for name, w in state.items():
        layer = name.removesuffix(".weight")
        if not (name.endswith(".weight") and layer.split(".")[-1] in LINEAR):
            packed[name] = exact[name] = w
            continue
        groups = _groups(name, w.shape[1], act_order, group)
        q, z, s = _quantize(w.float(), groups, sym)
        layers[layer] = (q, z, s, groups)
        if method == "gptq":
            stored = (z - 1) & 15 if fmt == "gptq" else z  # v1 stores zero - 1
            z = stored + 1 if fmt == "gptq" else z  # ... and readers add the one back
            packed[f"{layer}.qweight"] = _pack(q).t().contiguous()  # [K / 8, N]
            packed[f"{layer}.qzeros"] = _pack(stored.t())
            packed[f"{layer}.scales"] = s.t().contiguous()
            packed[f"{layer}.g_idx"] = groups.to(torch.int32)
        else:
            packed[f"{layer}.qweight"] = _pack(q.t(), AWQ_ORDER)
            packed[f"{layer}.qzeros"] = _pack(z.t(), AWQ_ORDER)
            packed[f"{layer}.scales"] = s.t().contiguous()
        exact[name] = (q - z[:, groups]).float() * s.float()[:, groups]
    if method == "gptq":
        config = {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": group,
            "desc_act": act_order,
            "sym": sym,
            "checkpoint_format": fmt,
            "static_groups": False,
        }
    else:
        config = {
            "quant_method": "awq",
            "bits": 4,
            "group_size": group,
            "zero_point": True,
            "version": "gemm",
        }
    _write(quantized, packed, config)
    _write(reference, exact)
    return quantized, reference, layers


@torch.no_grad()
def _logits(model: str, ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    config = ModelConfig.from_pretrained(model, dtype="float32", skip_tokenizer_init=True, **kwargs)
    net = load_model(EngineConfig(model=config))
    return net.compute_logits(net(ids, torch.arange(ids.numel())))


def _ids() -> torch.Tensor:
    return torch.randint(2, 300, (24,), generator=torch.Generator().manual_seed(0))


def _assert_matches_hf(quantized: str, reference: str) -> None:
    ids = _ids()
    ours = _logits(quantized, ids)
    with torch.no_grad():
        expected = hf_model(reference)(ids[None]).logits[0]
    torch.testing.assert_close(ours, expected, atol=ATOL, rtol=0)
    assert torch.equal(ours.argmax(-1), expected.argmax(-1))


GPTQ_CASES = {
    "sym-v1": (True, False, "gptq"),
    "asym-v1": (False, False, "gptq"),
    "asym-v2-act-order": (False, True, "gptq_v2"),
    "sym-v1-act-order": (True, True, "gptq"),
}


@pytest.mark.parametrize("case", sorted(GPTQ_CASES))
def test_gptq_logits_match_hf_on_the_dequantized_weights(tmp_path: Any, case: str) -> None:
    sym, act_order, fmt = GPTQ_CASES[case]
    quantized, reference, _ = _checkpoints(tmp_path, "gptq", sym, act_order, fmt)
    _assert_matches_hf(quantized, reference)


def test_awq_logits_match_hf_on_the_dequantized_weights(tmp_path: Any) -> None:
    _assert_matches_hf(*_checkpoints(tmp_path, "awq")[:2])


def _load(path: str, **kwargs: Any) -> Any:
    config = ModelConfig.from_pretrained(path, dtype="float32", skip_tokenizer_init=True, **kwargs)
    return load_model(EngineConfig(model=config))


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_layers_hold_the_checkpoints_integers(tmp_path: Any, method: str) -> None:
    """The fused q/k/v layer keeps q's, k's and v's integers and scales, in row order; with
    act-order its columns are sorted by group and its input permuted to match."""
    act_order = method == "gptq"
    quantized, _, layers = _checkpoints(tmp_path, method, act_order=act_order, fmt="gptq_v2")
    model = _load(quantized, quantization=method)
    assert model.lm_head.quant_weight is None or not isinstance(
        model.lm_head.quant_weight, QuantizedWeight
    )  # the checkpoint's LM head is float: it stays dense
    packed = model.model.layers[1].self_attn.qkv_proj.quant_weight
    assert isinstance(packed, QuantizedWeight) and (packed.bits, packed.group_size) == (4, GROUP)
    assert model.model.layers[1].self_attn.qkv_proj.weight.is_meta
    names = [f"model.layers.1.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")]
    q = torch.cat([layers[n][0] for n in names])
    z = torch.cat([layers[n][1] for n in names])
    s = torch.cat([layers[n][2] for n in names])
    groups = layers[names[0]][3]
    if act_order:
        perm = torch.sort(groups, stable=True).indices
        assert torch.equal(packed.input_perm, perm)
        q = q[:, perm]
    else:
        assert packed.input_perm is None
    assert torch.equal(unpack_int4(packed.qweight).long(), q)
    assert torch.equal(packed.scales.float(), s.float())
    assert torch.equal(packed.offsets.float(), -z.float() * s.float())
    assert packed.offsets.dtype == torch.float32  # -z * s does not fit float16 here


def test_symmetric_gptq_keeps_no_offsets(tmp_path: Any) -> None:
    """sym=True stores the midpoint 8 as every zero (7 in v1): the layers take int4's implicit
    offset -8 s with float16 scales, GGUF Q4_0's form."""
    quantized, _, _ = _checkpoints(tmp_path, "gptq", sym=True)
    packed = _load(quantized).model.layers[0].mlp.down_proj.quant_weight
    assert isinstance(packed, QuantizedWeight)
    assert packed.offsets is None and packed.scales.dtype == torch.float16


@pytest.mark.parametrize(
    ("method", "act_order"), [("gptq", True), ("awq", False)], ids=["gptq-act-order", "awq"]
)
def test_engine_gives_hf_greedy_tokens(tmp_path: Any, method: str, act_order: bool) -> None:
    """Through `LLM(...)`, chunked prefill (16-token chunks) and decode batches of 1 to 6 rows,
    so both the kernel (with act-order's input permutation) and the dequantized matmul run:
    HF's greedy tokens on all 18 prompts."""
    quantized, reference, _ = _checkpoints(tmp_path, method, act_order=act_order, fmt="gptq_v2")
    llm = LLM(quantized, dtype="float32", num_gpu_blocks=64, max_num_batched_tokens=16)
    assert llm.llm_engine.model_config.quantization == method  # detected from the checkpoint
    prompts = mixed_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(reference, prompt, MAX_TOKENS)


def test_quantization_is_real(tmp_path: Any) -> None:
    """Guards the parity tests against a loader that read the float weights: the checkpoint's
    int4 weights move the logits off the float model's."""
    dense = build_tiny_checkpoint(tmp_path, "LlamaForCausalLM", **SHAPE)
    quantized, _, _ = _checkpoints(tmp_path, "awq")
    ids = _ids()
    assert (_logits(quantized, ids) - _logits(dense, ids)).abs().max() > 1e-2


def test_groups_the_kernels_cannot_take_stay_dense(tmp_path: Any, caplog: Any) -> None:
    """Groups of 16 (int4 kernels need multiples of 32): the layers stay dense, dequantized
    exactly, with a log line naming them."""
    quantized, reference, _ = _checkpoints(tmp_path, "gptq", group=16)
    with caplog.at_level("INFO"):
        _assert_matches_hf(quantized, reference)
    assert "q_proj stays dense" in caplog.text
    model = _load(quantized)
    assert not isinstance(model.model.layers[0].mlp.down_proj.quant_weight, QuantizedWeight)


def _edit_config(path: str, **changes: Any) -> str:
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"].update(changes)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


@pytest.mark.parametrize(
    ("method", "changes", "message"),
    [
        ("gptq", {"bits": 3}, "bits=3 is not supported"),
        ("gptq", {"checkpoint_format": "marlin"}, "checkpoint_format='marlin' is not supported"),
        ("gptq", {"dynamic": {"-:.*mlp.*": {}}}, "dynamic"),
        ("gptq", {"group_size": 0}, "group_size must be a positive integer or -1"),
        ("gptq", {"group_size": 48}, "group_size=48 does not divide the input size"),
        ("awq", {"version": "gemv"}, "version='gemv' is not supported"),
        ("awq", {"zero_point": False}, "zero_point must be true"),
        ("awq", {"bits": 8}, "bits=8 is not supported"),
    ],
)
def test_bad_configs_name_the_field(
    tmp_path: Any, method: str, changes: dict[str, Any], message: str
) -> None:
    quantized = _edit_config(_checkpoints(tmp_path, method)[0], **changes)
    with pytest.raises(ValueError, match=message):
        _load(quantized)


def test_a_quantization_setting_that_contradicts_the_checkpoint_names_both(
    tmp_path: Any,
) -> None:
    quantized = _checkpoints(tmp_path, "gptq")[0]
    with pytest.raises(ValueError, match="quantization='awq' does not match .*'gptq'"):
        LLM(quantized, quantization="awq")
    with pytest.raises(ValueError, match="quantization='int4' does not match"):
        LLM(quantized, quantization="int4")
    assert _load(quantized, quantization="gptq_marlin") is not None  # vLLM's kernel name


def test_gptq_8bit_layers_keep_their_integers() -> None:
    """8 bits: four values per word; v1's midpoint zero (128, stored 127) needs no offsets."""
    from tokenwise.layers.quantization import gptq
    from tokenwise.layers.quantization.weight_only import reference_dequantize
    from tokenwise.quantization_config import int_checkpoint_config

    gen = torch.Generator().manual_seed(0)
    n, k = 48, 64
    q = torch.randint(0, 256, (n, k), generator=gen)
    s = (torch.rand(n, k // GROUP, generator=gen) / 50).half()
    words = torch.zeros(k // 4, n, dtype=torch.int64)
    for j in range(4):
        words |= q.t()[j::4] << (8 * j)
    zeros = torch.full((k // GROUP, n // 4), 0x7F7F7F7F, dtype=torch.int32)  # 127 each
    parts = {
        "qweight": torch.where(words >= 2**31, words - 2**32, words).to(torch.int32),
        "qzeros": zeros,
        "scales": s.t().contiguous(),
    }
    config = int_checkpoint_config("gptq", {"bits": 8, "group_size": GROUP})
    converted = gptq.convert(config, "layer", parts)
    expected = (q - 128).float() * s.float().repeat_interleave(GROUP, dim=1)
    assert torch.equal(converted.dense, expected)
    record = converted.record
    assert record is not None and record.bits == 8 and record.offsets is None
    assert torch.equal(record.qweight.long(), q - 128)
    assert torch.equal(reference_dequantize(record), expected)


def test_fused_parts_in_different_input_orders_stay_dense(tmp_path: Any) -> None:
    """vLLM's act-order kernels assume q, k and v share one g_idx; where a checkpoint's differ
    the fused layer cannot permute one input for all three: it stays dense, with the exact
    dequantized weights."""
    quantized, reference, _ = _checkpoints(tmp_path, "gptq", act_order=True, fmt="gptq_v2")
    state = load_file(os.path.join(quantized, "model.safetensors"))
    k_rows = {}
    for layer in (0, 1):  # rebuild k_proj with another column order: same values, new g_idx
        prefix = f"model.layers.{layer}.self_attn.k_proj"
        w = load_file(os.path.join(reference, "model.safetensors"))[f"{prefix}.weight"]
        groups = _groups(f"{prefix}.other.weight", w.shape[1], True)
        q, z, s = _quantize(w, groups, sym=False)
        state[f"{prefix}.qweight"] = _pack(q).t().contiguous()
        state[f"{prefix}.qzeros"] = _pack(z.t())
        state[f"{prefix}.scales"] = s.t().contiguous()
        state[f"{prefix}.g_idx"] = groups.to(torch.int32)
        k_rows[layer] = (q - z[:, groups]).float() * s.float()[:, groups]
    save_file(state, os.path.join(quantized, "model.safetensors"), metadata={"format": "pt"})
    model = _load(quantized)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert not isinstance(qkv.quant_weight, QuantizedWeight)
    n = qkv.weight.shape[1]  # q's rows (hidden size), then k's
    assert torch.equal(qkv.weight[n : n + k_rows[0].shape[0]], k_rows[0])
    assert isinstance(model.model.layers[0].self_attn.o_proj.quant_weight, QuantizedWeight)


@pytest.mark.parametrize("rows", [1, 5, 8, 20, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_permuted_input_layers_compute_their_dense_weight(
    rows: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`input_perm` on every path: the kernel (up to 8 rows, blocks of 8 up to 32) and the
    dequantized matmul beyond; `dequantize` and `reference_dequantize` undo the order. (bf16 x
    on the int16 path, whose error this tolerance bounds; the int8 path's own bound is in
    test_qgemv_activations.py.)"""
    from tokenwise.layers.quantization.prequantized import group_dense, integer_weight
    from tokenwise.layers.quantization.weight_only import reference_dequantize
    from tokenwise.native import qgemv as cpu_qgemv

    monkeypatch.setattr(cpu_qgemv, "activation_bits", lambda: 16)
    gen = torch.Generator().manual_seed(rows)
    n, k = 48, 128
    groups = _groups("model.layers.0.mlp.down_proj.weight", k, act_order=True)
    q = torch.randint(0, 16, (n, k), generator=gen)
    z = torch.randint(0, 16, (n, k // GROUP), generator=gen)
    s = (torch.rand(n, k // GROUP, generator=gen) / 10).half()
    record = integer_weight("layer", q, z, s, 4, groups, signed=False)
    dense = group_dense(q, z, s, groups)
    assert record is not None and record.input_perm is not None
    assert torch.equal(reference_dequantize(record), dense)
    assert torch.equal(record.dequantize(torch.float32), dense)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    expected = torch.nn.functional.linear(x.float(), dense, bias.float())
    # bfloat16: outputs of ~20 rounded to 8 bits (and, past 32 rows, the weights too).
    atol, rtol = (1e-4, 0.0) if dtype == torch.float32 else (5e-2, 1e-2)
    torch.testing.assert_close(record.linear(x, bias).float(), expected, atol=atol, rtol=rtol)


def test_tensor_parallel_engine_gives_hf_greedy_tokens(tmp_path: Any) -> None:
    """TP=2 through `LLM(...)` (spawned workers, paged cache, decode batches): each rank holds
    its slice of the checkpoint's integers (`tp_slice`, checked field by field in
    test_tp_exact.py), so the tokens are HF's on the dequantized weights. With act-order, the
    hardest layout: o_proj / down_proj in padded groups (`act_order_slice`)."""
    quantized, reference, _ = _checkpoints(tmp_path, "gptq", act_order=True, fmt="gptq_v2")
    prompts = mixed_prompts()[:6]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm = LLM(quantized, dtype="float32", tensor_parallel_size=2, num_gpu_blocks=64)
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(reference, prompt, MAX_TOKENS)
