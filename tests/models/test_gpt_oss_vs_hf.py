"""gpt-oss against Hugging Face transformers on tiny checkpoints, dense and MXFP4.

The tiny model (tests/tiny_checkpoints.py) has sinks, a window of 8 on alternate layers, YaRN,
biases everywhere (noised, so each one counts) and a SwiGLU clamp that binds. Logits are
compared outside the engine, then greedy tokens through `tokenwise.LLM` against HF `generate`
under one batch, chunked prefill (16-token budget), a pool small enough to preempt, a second
pass with prefix-cache hits, and tensor parallelism over two processes. The MXFP4 checkpoint is
written here in the published layout (`*_blocks` + `*_scales`, random weights quantized with
`mxfp4.quantize`); HF gets the same weights dequantized into a dense checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.engine._fixtures import assert_pool_clean, checkpoint, hf_greedy, mixed_prompts
from tests.tiny_checkpoints import build_tiny_checkpoint
from tokenwise import LLM, SamplingParams
from tokenwise.config import EngineConfig
from tokenwise.layers.quantization import mxfp4
from tokenwise.loader import load_model
from tokenwise.model_config import ModelConfig

ARCH = "GptOssForCausalLM"
MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
SEQ_LEN = 40  # past the window of 8 and several blocks


def _ids() -> torch.Tensor:
    return torch.randint(2, 300, (SEQ_LEN,), generator=torch.Generator().manual_seed(0))


def _logits(path: str) -> torch.Tensor:
    model = load_model(EngineConfig(model=ModelConfig.from_pretrained(path, dtype="float32")))
    ids = _ids()
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(ids.numel())))


def _hf_logits(path: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(_ids()[None]).logits[0]


def _write_mxfp4(dense: str, out: Path) -> tuple[str, str]:
    """(an MXFP4 checkpoint of `dense`'s model, a dense one holding exactly its values)."""
    mx, ref = out / "mxfp4", out / "dequantized"
    shutil.copytree(dense, mx)
    shutil.copytree(dense, ref)
    tensors = load_file(os.path.join(dense, "model.safetensors"))
    quantized, dequantized = {}, {}
    for name, t in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = mxfp4.quantize(t.transpose(1, 2))  # rows of the [out, in] weight
            quantized[name + "_blocks"], quantized[name + "_scales"] = blocks, scales
            back = mxfp4.dequantize(blocks, scales, torch.float32).transpose(1, 2)
            dequantized[name] = back.contiguous()
        else:
            quantized[name] = dequantized[name] = t
    save_file(quantized, str(mx / "model.safetensors"), metadata={"format": "pt"})
    save_file(dequantized, str(ref / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((mx / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (mx / "config.json").write_text(json.dumps(config))
    return str(mx), str(ref)


@pytest.fixture(scope="module")
def mxfp4_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    return _write_mxfp4(checkpoint(ARCH), tmp_path_factory.mktemp("gptoss-mxfp4"))


def test_logits_match_hf() -> None:
    path = checkpoint(ARCH)
    torch.testing.assert_close(_logits(path), _hf_logits(path), atol=1e-4, rtol=0)


def test_sinks_and_window_change_the_logits(tmp_path: Path) -> None:
    """Guards the comparison above: zero sinks, or no window, give other logits."""
    path = checkpoint(ARCH)
    ours = _logits(path)
    no_sinks = build_tiny_checkpoint(tmp_path, ARCH)
    file = os.path.join(no_sinks, "model.safetensors")
    tensors = load_file(file)
    for name in [n for n in tensors if n.endswith("sinks")]:
        tensors[name] = torch.full_like(tensors[name], -1e4)
    save_file(tensors, file, metadata={"format": "pt"})
    assert (_logits(no_sinks) - ours).abs().max() > 1e-2
    full = build_tiny_checkpoint(tmp_path, ARCH, sliding_window=4096)
    diff = (_logits(full) - ours).abs().amax(-1)
    assert diff[:8].max() < 1e-5 and diff[8:].min() > 1e-3


def test_mxfp4_checkpoint_matches_hf_on_dequantized_weights(mxfp4_pair: tuple[str, str]) -> None:
    mx, ref = mxfp4_pair
    model = load_model(EngineConfig(model=ModelConfig.from_pretrained(mx, dtype="float32")))
    experts = model.model.layers[0].mlp.experts
    assert experts.w13_blocks.dtype == torch.uint8 and not hasattr(experts, "w13_weight")
    torch.testing.assert_close(_logits(mx), _hf_logits(ref), atol=1e-4, rtol=0)


def _engine_tokens(path: str, prompts: list[list[int]], **kwargs: Any) -> tuple[Any, list[Any]]:
    llm = LLM(path, dtype="float32", seed=0, **{"num_gpu_blocks": 256, **kwargs})
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    second = llm.generate(prompts[:6], GREEDY, use_tqdm=False)  # prefix-cache pass
    assert_pool_clean(llm.llm_engine)
    got = [list(o.outputs[0].token_ids) for o in outputs]
    assert [list(o.outputs[0].token_ids) for o in second] == got[:6]
    return llm, got


# 17 blocks: one 192-token sequence holds 12 in the full layer's group and 3 in the window's.
SCHEDULES = {
    "one-batch": {},
    "chunked-16": {"max_num_batched_tokens": 16},
    "preempt-chunked-16": {
        "max_model_len": 192,
        "max_num_batched_tokens": 16,
        "num_gpu_blocks": 17,
    },
}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_greedy_tokens_match_hf(schedule: str) -> None:
    """All 18 mixed prompts (1..95 tokens, four sharing a 40-token prefix) equal HF."""
    path = checkpoint(ARCH)
    prompts = mixed_prompts()
    refs = [hf_greedy(path, p, MAX_TOKENS) for p in prompts]
    llm, got = _engine_tokens(path, prompts, **SCHEDULES[schedule])
    for i, (tokens, want) in enumerate(zip(got, refs, strict=True)):
        assert tokens == want, f"{schedule}: prompt {i} of {len(prompts[i])} tokens"
    assert llm.llm_engine.get_stats().prefix_cache_hits > 0
    if schedule.startswith("preempt"):
        assert llm.llm_engine.scheduler.num_preemptions > 0, "the small pool should preempt"


def test_mxfp4_greedy_tokens_match_hf(mxfp4_pair: tuple[str, str]) -> None:
    mx, ref = mxfp4_pair
    prompts = mixed_prompts()[:8]
    refs = [hf_greedy(ref, p, MAX_TOKENS) for p in prompts]
    _, got = _engine_tokens(mx, prompts, max_num_batched_tokens=16)
    assert got == refs


def test_tensor_parallel_2_matches_hf(mxfp4_pair: tuple[str, str]) -> None:
    """Heads, sinks, the experts' intermediate slice (dense and MXFP4 groups) over 2 ranks."""
    mx, ref = mxfp4_pair
    prompts = mixed_prompts()[:6]
    for path, hf_path in ((checkpoint(ARCH), checkpoint(ARCH)), (mx, ref)):
        refs = [hf_greedy(hf_path, p, MAX_TOKENS) for p in prompts]
        llm, got = _engine_tokens(path, prompts, tensor_parallel_size=2)
        llm.shutdown()  # one tensor-parallel engine per process at a time
        assert got == refs, path


def test_mxfp4_refusals(tmp_path: Path, mxfp4_pair: tuple[str, str]) -> None:
    dense = checkpoint(ARCH)
    with pytest.raises(ValueError, match="needs an MXFP4 checkpoint"):
        ModelConfig.from_pretrained(dense, dtype="float32", quantization="mxfp4")
    llama = build_tiny_checkpoint(tmp_path, "LlamaForCausalLM")
    config = json.loads(Path(llama, "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    Path(llama, "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"gpt-oss \(GptOssForCausalLM\) experts only"):
        ModelConfig.from_pretrained(llama, dtype="float32")
    mx, _ = mxfp4_pair
    wrong = tmp_path / "wrong"
    shutil.copytree(mx, wrong)
    tensors = load_file(str(wrong / "model.safetensors"))
    name = "model.layers.0.mlp.experts.down_proj_scales"
    tensors[name] = tensors[name][:, :, :1].contiguous()
    save_file(tensors, str(wrong / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        load_model(EngineConfig(model=ModelConfig.from_pretrained(str(wrong), dtype="float32")))
