"""`kv_cache_dtype="fp8"` in the engine: capacity, greedy parity with the model-dtype cache,
chunked prefill and preemption, and the refusals.

Precision, and the bound below: e4m3 keeps 3 mantissa bits, so each stored K/V element is
within a relative 2^-4 of the true one (round to nearest). A prompt's own K/V are attended
unquantized during its prefill (as in vLLM), so without chunking or prefix hits the first
token's logprob is exactly the model-dtype cache's; a chunk or prefix hit reads the earlier
tokens back from the fp8 cache. This tiny model (std-0.2 weights, picked for peaked attention
and decisive greedy choices against HF) amplifies that 2^-4 by up to ~6x in a log-probability
(measured 0.39 nats at most here), so the bound is 8 * 2^-4 = 0.5 nats. Its top-2 logprob
margins are often below 0.1 nats, so a rounding can flip a greedy choice a few tokens in: the
tests ask for the first tokens of most prompts, not all tokens of all of them.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from transformers import AutoConfig

from tests.engine._fixtures import LLAMA, assert_pool_clean, checkpoint, mixed_prompts
from tokenwise import LLM, SamplingParams
from tokenwise.entrypoints.engine_args import add_engine_args, build_engine_config, engine_kwargs

E4M3_LOGPROB_BOUND = 8 * 2**-4
MAX_TOKENS = 16  # enough decode steps to crowd the preempting pool
COMPARED = 3  # leading tokens compared (see the module docstring)


@pytest.fixture(scope="module")
def path() -> str:
    return checkpoint(LLAMA)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Ten prompts of 8-44 tokens (a one-token prompt is scheduled as a decode row, which
    reads its only key back from the cache), four of them sharing a 40-token prefix."""
    return [p for p in mixed_prompts() if len(p) >= 2][:10]


def _greedy(path: str, prompts: list[list[int]], **kwargs: Any) -> tuple[list, list, Any]:
    """Tokens and each first token's logprob; and the engine, to inspect afterwards."""
    args: dict[str, Any] = {"dtype": "float32", "num_gpu_blocks": 256} | kwargs
    llm = LLM(path, **args)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    first = [o.outputs[0].logprobs[0] for o in outs]
    return tokens, first, llm.llm_engine


@pytest.fixture(scope="module")
def reference(path: str, prompts: list[list[int]]) -> tuple[list, list]:
    tokens, first, _ = _greedy(path, prompts, enable_prefix_caching=False)
    return tokens, [lp[t[0]].logprob for t, lp in zip(tokens, first, strict=True)]


def test_unchunked_prefill_gives_the_same_first_token_exactly(
    path: str, prompts: list[list[int]], reference: tuple[list, list]
) -> None:
    tokens, first, engine = _greedy(
        path, prompts, kv_cache_dtype="fp8", enable_prefix_caching=False
    )
    assert engine.runner.kv_caches[next(iter(engine.runner.kv_caches))].dtype == (
        torch.float8_e4m3fn
    )
    ref_tokens, ref_first = reference
    assert [t[0] for t in tokens] == [t[0] for t in ref_tokens]
    assert [lp[t[0]].logprob for t, lp in zip(tokens, first, strict=True)] == ref_first
    # Later tokens attend over the fp8 cache: most prompts keep their leading ones.
    assert sum(a[:COMPARED] == b[:COMPARED] for a, b in zip(tokens, ref_tokens, strict=True)) >= 7
    assert_pool_clean(engine)


@pytest.mark.parametrize(
    "settings",
    [
        {"max_num_batched_tokens": 16},
        # 8 blocks for 4 running sequences of up to 47 tokens: requests are preempted and
        # recomputed (prefix caching on: recomputation hits the cached fp8 blocks).
        {"max_num_batched_tokens": 16, "num_gpu_blocks": 8, "max_num_seqs": 4},
    ],
    ids=["chunked", "chunked-preempting"],
)
def test_chunked_and_preempted_within_the_e4m3_bound(
    path: str, prompts: list[list[int]], reference: tuple[list, list], settings: dict
) -> None:
    tokens, first, engine = _greedy(
        path, prompts, kv_cache_dtype="fp8", max_model_len=128, **settings
    )
    ref_tokens, ref_first = reference
    if "num_gpu_blocks" in settings:
        assert engine.scheduler.num_preemptions > 0  # the crowding was real
    same_first = [i for i, t in enumerate(tokens) if t[0] == ref_tokens[i][0]]
    assert len(same_first) >= 9
    for i in same_first:
        lp = first[i][tokens[i][0]].logprob
        assert abs(lp - ref_first[i]) <= E4M3_LOGPROB_BOUND, (i, lp, ref_first[i])
    assert sum(a[:COMPARED] == b[:COMPARED] for a, b in zip(tokens, ref_tokens, strict=True)) >= 6
    assert_pool_clean(engine)


def _bytes_per_token_bf16(path: str) -> int:
    """K and V, every layer, in bf16: what one cached token costs (from HF's config)."""
    cfg = AutoConfig.from_pretrained(path)
    head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head * 2


def test_fp8_cache_holds_twice_the_blocks_of_bf16(
    path: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The same kv_cache_memory: 2x the blocks of a bf16 cache, 4x of an fp32 one."""
    memory = 64 * 16 * _bytes_per_token_bf16(path)  # exactly 64 bf16 blocks of 16 tokens
    blocks = {}
    for dtype, cache in [("bfloat16", "auto"), ("float32", "auto"), ("bfloat16", "fp8")]:
        with caplog.at_level(logging.INFO, logger="tokenwise.runner.model_runner"):
            caplog.clear()
            llm = LLM(path, dtype=dtype, kv_cache_memory=memory, kv_cache_dtype=cache)
        blocks[dtype, cache] = llm.llm_engine.block_manager.num_blocks
        if cache == "fp8":
            assert "dtype float8_e4m3fn" in caplog.text  # the capacity line says the dtype
    assert blocks["bfloat16", "auto"] == 64
    assert blocks["bfloat16", "fp8"] == 2 * 64
    assert blocks["float32", "auto"] == 64 // 2


@pytest.mark.parametrize("bad", ["fp16", "int8", "fp8_e4m3fn", ""])
def test_bad_kv_cache_dtype_names_the_parameter(path: str, bad: str) -> None:
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of auto, bfloat16, fp8"):
        build_engine_config(path, kv_cache_dtype=bad)


def test_cli_flag_reaches_the_engine_config(path: str) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--kv-cache-dtype", "fp8_e5m2"])
    config = build_engine_config(path, **engine_kwargs(args))
    assert config.cache.cache_dtype == "fp8_e5m2"
    assert engine_kwargs(parser.parse_args([]))["kv_cache_dtype"] == "auto"


@pytest.mark.parametrize(
    ("arch", "kwargs", "message"),
    [
        ("BertModel", {"task": "embed"}, r"not supported for task='embed' \(pooling\) models"),
        ("BartForConditionalGeneration", {}, "not supported for encoder-decoder models"),
        ("DeepseekV2ForCausalLM", {}, "not supported for the MLA latent cache of layer"),
    ],
    ids=["pooling", "encoder-decoder", "mla"],
)
def test_caches_without_an_fp8_path_refuse_it_by_name(
    tmp_path: Any, arch: str, kwargs: dict, message: str
) -> None:
    """Embedding models, cross caches and DeepSeek's MLA latent have no fp8 path: refused,
    naming `kv_cache_dtype` and the model kind (MLA when the runner sizes the cache)."""
    from tests.tiny_checkpoints import build_tiny_checkpoint

    model = build_tiny_checkpoint(tmp_path, arch)
    with pytest.raises(ValueError, match=f"kv_cache_dtype='fp8' is {message}"):
        LLM(model, dtype="float32", num_gpu_blocks=64, kv_cache_dtype="fp8", **kwargs)


def _with_kv_scales(tmp_path: Any, scales: dict[str, torch.Tensor]) -> str:
    """A private tiny Llama whose safetensors also hold the given KV-cache scale tensors."""
    from safetensors.torch import load_file, save_file

    from tests.tiny_checkpoints import build_tiny_checkpoint

    model = build_tiny_checkpoint(tmp_path, LLAMA)
    file = f"{model}/model.safetensors"
    save_file({**load_file(file), **scales}, file, metadata={"format": "pt"})
    return model


def test_checkpoint_kv_scales_reach_the_layers(
    tmp_path: Any, prompts: list[list[int]], reference: tuple[list, list]
) -> None:
    """llm-compressor's `self_attn.k_scale` / `v_scale` and ModelOpt's `k_proj.k_scale` are
    read onto each layer for an fp8 cache (and dropped for any other); with them the cache
    still reproduces the model within the e4m3 bound."""
    layers = AutoConfig.from_pretrained(checkpoint(LLAMA)).num_hidden_layers
    scales = {}
    for i in range(layers):
        scales[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.25 + i)
        scales[f"model.layers.{i}.self_attn.v_proj.v_scale"] = torch.tensor([0.5 + i])
    model = _with_kv_scales(tmp_path, scales)
    tokens, first, engine = _greedy(
        model, prompts, kv_cache_dtype="fp8", max_num_batched_tokens=16, max_model_len=128
    )
    impls = [layer.impl for layer in engine.runner.attn_layers.values()]
    assert [(m.k_scale, m.v_scale) for m in impls] == [(0.25 + i, 0.5 + i) for i in range(layers)]
    ref_tokens, ref_first = reference
    for i, t in enumerate(tokens):
        if t[0] == ref_tokens[i][0]:
            assert abs(first[i][t[0]].logprob - ref_first[i]) <= E4M3_LOGPROB_BOUND
    assert sum(a[:COMPARED] == b[:COMPARED] for a, b in zip(tokens, ref_tokens, strict=True)) >= 6
    _, _, plain = _greedy(model, prompts[:1])
    assert {(m.impl.k_scale, m.impl.v_scale) for m in plain.runner.attn_layers.values()} == {
        (1.0, 1.0)
    }


def test_a_bad_kv_scale_names_the_tensor(tmp_path: Any) -> None:
    model = _with_kv_scales(tmp_path, {"model.layers.0.self_attn.k_scale": torch.tensor(-1.0)})
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.k_scale must be one finite"):
        LLM(model, dtype="float32", num_gpu_blocks=64, kv_cache_dtype="fp8")
