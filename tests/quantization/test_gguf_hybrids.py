"""GGUF files of Qwen3.5, Qwen3.5-MoE, Qwen3-Next and gpt-oss (MXFP4 experts) compute what
transformers computes on the same weights.

The files are written as llama.cpp's converter writes them (`_gguf_hybrid_files.py`, which
restates `convert_hf_to_gguf.py`; `test_the_real_converter_writes_the_same_file` runs the real
one where its source is at hand). The tiny hybrids have fewer key than value heads, so
Qwen3.5's value-head reorder, Qwen3-Next's q/k/v/z split, the stored `-exp(A_log)` and the
norms stored plus one all change the logits when read back wrong.

References: transformers on the checkpoint the file was written from (F32), on that
checkpoint's matrices rounded through Q8_0 as the file holds them (`q8_0_reference`; exact
where the converter only moves whole rows or whole blocks: Qwen3-Next, and Qwen3.5 with
32-wide value heads), and for gpt-oss on the MXFP4 experts dequantized. The bar: HF's argmax,
logits within 1e-4 for gpt-oss and 1e-3 for the hybrids (tokenwise's own Gated DeltaNet
kernels differ from transformers' by ~2e-4 on these models, from their checkpoint
directories too), and for F32 files the logits tokenwise computes from the checkpoint
directory within 1e-5 (the file's tensors read back to the checkpoint's).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests._optional import skip_or_fail_in_ci
from tests.engine._fixtures import hf_greedy
from tests.models.test_gpt_oss_vs_hf import _write_mxfp4
from tests.quantization._gguf_hybrid_files import write_hybrid_gguf
from tests.quantization.test_gguf_archs import _ids, _ours  # 24 random ids; fp32 logits
from tests.tiny_checkpoints import build_tiny_checkpoint, tiny_tokenizer
from tokenwise import LLM, SamplingParams
from tokenwise.gguf.gpt_oss_config import gpt_oss_kwargs
from tokenwise.gguf.hf_config import gguf_hf_config
from tokenwise.model_config import ModelConfig
from tokenwise.tools.llamacpp_source import find_source

pytestmark = pytest.mark.usefixtures("exact_fp32_activations")  # compared with transformers

Q = gguf.GGMLQuantizationType
# case -> (architecture, config overrides, file type)
CASES: dict[str, tuple[str, dict[str, Any], Any]] = {
    "qwen35": ("Qwen3_5ForCausalLM", {}, Q.F32),
    "qwen35_q8_0": ("Qwen3_5ForCausalLM", {"linear_value_head_dim": 32}, Q.Q8_0),
    "qwen35moe": ("Qwen3_5MoeForCausalLM", {}, Q.F32),
    "qwen3next": ("Qwen3NextForCausalLM", {}, Q.F32),
    "qwen3next_q8_0": ("Qwen3NextForCausalLM", {}, Q.Q8_0),
    # llama.cpp clamps gpt-oss's SwiGLU at 7 (the file has no key for it)
    "gpt_oss_mxfp4": ("GptOssForCausalLM", {"swiglu_limit": 7.0}, "MXFP4"),
    "gpt_oss_f32": ("GptOssForCausalLM", {"swiglu_limit": 7.0}, Q.F32),  # dense experts
}
ATOL = {"GptOssForCausalLM": 1e-4}
HYBRID_ATOL = 1e-3


@pytest.fixture(autouse=True)
def _tokenizer_cache(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENWISE_GGUF_CACHE", str(tmp_path / "tokenizers"))


def q8_0_reference(hf_dir: str, out: Path) -> str:
    """The checkpoint with every matrix the converter quantizes rounded through Q8_0 (F16 for
    rows that are not whole blocks; routers, gates of one row, convs and vectors as they are)."""
    shutil.copytree(hf_dir, out)
    state = load_file(os.path.join(hf_dir, "model.safetensors"))
    for name, t in state.items():
        if t.dim() != 2 or name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
            continue
        qtype = Q.Q8_0 if t.shape[-1] % 32 == 0 else Q.F16
        values = gguf.quants.dequantize(gguf.quants.quantize(t.numpy(), qtype), qtype)
        state[name] = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str, str]]:
    """case -> (checkpoint the file was written from, GGUF file, HF reference directory)."""
    root = tmp_path_factory.mktemp("gguf-hybrids")
    out = {}
    for case, (arch, overrides, qtype) in CASES.items():
        hf_dir = build_tiny_checkpoint(root / case, arch, **overrides)
        reference = hf_dir
        if qtype == "MXFP4":
            hf_dir, reference = _write_mxfp4(hf_dir, root / case / "mx")
            qtype = Q.F32
        elif qtype != Q.F32:
            reference = q8_0_reference(hf_dir, root / case / "reference")
        path = write_hybrid_gguf(hf_dir, str(root / f"{case}.gguf"), qtype)
        out[case] = (hf_dir, path, reference)
    return out


@torch.no_grad()
def _hf(path: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model(_ids()[None]).logits[0]


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_hf(files: dict, case: str) -> None:
    hf_dir, path, reference = files[case]
    arch, _, qtype = CASES[case]
    _, ours = _ours(path)
    want = _hf(reference)
    assert want.std() > 0.5
    torch.testing.assert_close(ours, want, atol=ATOL.get(arch, HYBRID_ATOL), rtol=0)
    assert torch.equal(ours.argmax(-1), want.argmax(-1))
    if qtype == Q.F32:  # the file's tensors are the checkpoint's, read back exactly
        torch.testing.assert_close(ours, _ours(hf_dir)[1], atol=1e-5, rtol=0)


def test_config_read_from_the_file_is_the_checkpoints(files: dict) -> None:
    for case in ("qwen35", "qwen3next", "gpt_oss_mxfp4"):
        hf_dir, path, _ = files[case]
        ours, theirs = gguf_hf_config(path), json.loads(Path(hf_dir, "config.json").read_text())
        for key in ("layer_types", "linear_num_key_heads", "linear_num_value_heads"):
            assert getattr(ours, key, None) == theirs.get(key), (case, key)
        for key in ("linear_key_head_dim", "linear_value_head_dim", "head_dim", "sliding_window"):
            assert getattr(ours, key, None) == theirs.get(key), (case, key)
    assert gguf_hf_config(files["gpt_oss_mxfp4"][1]).quantization_config == {
        "quant_method": "mxfp4"
    }


def test_mxfp4_experts_stay_4bit_with_the_published_codes(files: dict) -> None:
    """The file's MXFP4 blocks, repacked, are bitwise the published checkpoint's codes and
    scales (as tokenwise loads them from the checkpoint directory); nothing dense is kept."""
    hf_dir, path, _ = files["gpt_oss_mxfp4"]
    from_file, _ = _ours(path)
    from_dir, _ = _ours(hf_dir)
    for a, b in zip(from_file.model.layers, from_dir.model.layers, strict=True):
        experts, published = a.mlp.experts, b.mlp.experts
        assert not hasattr(experts, "w13_weight")
        for name in ("w13_blocks", "w13_scales", "w2_blocks", "w2_scales"):
            mine = getattr(experts, name)
            assert mine.dtype == torch.uint8 and torch.equal(mine, getattr(published, name))


@pytest.mark.parametrize("case", ["qwen35moe", "gpt_oss_mxfp4"])
def test_engine_greedy_tokens_match_hf(files: dict, case: str) -> None:
    """End to end: the tokenizer from the file's metadata, HF's greedy tokens."""
    _, path, reference = files[case]
    llm = LLM(path, dtype="float32", num_gpu_blocks=64, block_size=16)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = ["The quick brown fox", "def fibonacci(n):"]
    for output in llm.generate(prompts, params, use_tqdm=False):
        want = hf_greedy(reference, list(output.prompt_token_ids), 12)
        assert list(output.outputs[0].token_ids) == want


def test_qwen3next_q8_0_under_tensor_parallel_2_matches_hf(files: dict) -> None:
    """Two ranks each take their rows of the quantized in_proj (the file's Q8_0 rows, regrouped
    per key head); the tokenizer transformers cannot read from a qwen3next file is built from
    its tokenizer keys and tokenizes as the checkpoint's does."""
    _, path, reference = files["qwen3next_q8_0"]
    llm = LLM(path, dtype="float32", num_gpu_blocks=64, block_size=16, tensor_parallel_size=2)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        prompts = ["Hello world! Hello", "import os\nimport"]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        for prompt, output in zip(prompts, outputs, strict=True):
            assert list(output.prompt_token_ids) == tiny_tokenizer().encode(prompt)
            want = hf_greedy(reference, list(output.prompt_token_ids), 10)
            assert list(output.outputs[0].token_ids) == want
    finally:
        llm.shutdown()


def test_missing_linear_attention_key_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hf_dir = build_tiny_checkpoint(tmp_path, "Qwen3_5ForCausalLM")
    monkeypatch.setattr(gguf.GGUFWriter, "add_ssm_time_step_rank", lambda self, value: None)
    path = write_hybrid_gguf(hf_dir, str(tmp_path / "broken.gguf"))
    with pytest.raises(ValueError, match=r"lacks the metadata key qwen35\.ssm\.time_step_rank"):
        ModelConfig.from_pretrained(path, dtype="float32", skip_tokenizer_init=True)


def _converter_source() -> str | None:
    """llama.cpp's source (with `convert_hf_to_gguf.py`): $LLAMACPP_SOURCE, else the one
    `make test` fetched into the cache (`tokenwise.tools.llamacpp_source`)."""
    given = os.environ.get("LLAMACPP_SOURCE")
    if given:
        return given if os.path.isfile(os.path.join(given, "convert_hf_to_gguf.py")) else None
    found = find_source()
    return None if found is None else str(found)


CONVERT = """
import sys
root = sys.argv[1]
sys.path[:0] = [root, root + "/gguf-py"]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"  # byte-level BPE
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
convert_hf_to_gguf.main()
"""


@pytest.mark.parametrize("case", ["qwen35", "qwen35moe", "qwen3next", "gpt_oss_mxfp4"])
def test_the_real_converter_writes_the_same_file(files: dict, case: str, tmp_path: Path) -> None:
    if _converter_source() is None:
        skip_or_fail_in_ci(
            "llama.cpp's converter is not at hand: `make test` fetches it "
            "(python -m tokenwise.tools.llamacpp_source), or set LLAMACPP_SOURCE"
        )
    hf_dir, path, _ = files[case]
    out = str(tmp_path / "converted.gguf")
    cmd = [sys.executable, "-c", CONVERT, str(_converter_source()), hf_dir, "--outtype", "f32"]
    cmd += ["--outfile", out] + (["--no-mtp"] if case.startswith("qwen") else [])
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    theirs, mine = gguf.GGUFReader(out), gguf.GGUFReader(path)
    assert sorted(t.name for t in theirs.tensors) == sorted(t.name for t in mine.tensors)
    by_name = {t.name: t for t in mine.tensors}
    for t in theirs.tensors:
        assert t.tensor_type == by_name[t.name].tensor_type, t.name
        assert np.array_equal(np.asarray(t.data), np.asarray(by_name[t.name].data)), t.name
    skip = ("general.", "GGUF.", "tokenizer.")
    keys = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith(skip)}
    assert keys == {k: f.contents() for k, f in mine.fields.items() if not k.startswith(skip)}


def test_gpt_oss_with_mixed_expert_types_is_refused() -> None:
    metadata = {
        "gpt-oss.expert_count": 4,
        "gpt-oss.expert_used_count": 2,
        "gpt-oss.expert_feed_forward_length": 64,
        "gpt-oss.attention.sliding_window": 8,
    }
    types = {"blk.0.ffn_gate_exps.weight": "MXFP4", "blk.0.ffn_down_exps.weight": "Q8_0"}
    base = {"num_hidden_layers": 2, "rope_theta": 150000.0}
    with pytest.raises(NotImplementedError, match=r"mixes MXFP4 experts with \['Q8_0'\]"):
        gpt_oss_kwargs(metadata, types, base, "mixed.gguf")
