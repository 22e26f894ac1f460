"""MTP speculation from the MTP head of a Qwen3.5 / Qwen3-Next GGUF file.

Tiny checkpoints get an MTP head (`mtp.*`) and are converted by llama.cpp's own converter
(`convert_hf_to_gguf.py`, which `make test` fetches; `test_gguf_hybrids` runs it the same way),
which writes the head as the block after the decoder with `nextn` tensors. The head built from
the file must hold the checkpoint directory's tensors (after the converter's rewrites are
undone); greedy output with it must be the file's own greedy output (lossless) and, from an
F32 file, the directory's with its head, draft for draft. A file without the head is refused.

The target is made to count, mostly (the next token after t is t + 1: random equal-norm
embeddings, the LM head's row v the embedding of v - 1, every layer's output projection scaled
down so the embedding dominates; on the Qwen3.5 checkpoint about a quarter of its steps still
go elsewhere), and its head to predict that: `fc` passes the next token's embedding through,
plus noise, so most drafts are accepted and some are not. Everything else in the head's layer
is a noisy copy of the target's full-attention layer, so a tensor read into the wrong place
shows in the tensor comparison.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests._optional import skip_or_fail_in_ci
from tests.quantization._gguf_files import write_gguf
from tests.quantization._gguf_hybrid_files import write_hybrid_gguf
from tests.quantization.test_gguf_hybrids import CONVERT, _converter_source
from tests.tiny_checkpoints import build_tiny_checkpoint
from tokenwise import LLM, SamplingParams
from tokenwise.loader import quantized_layer_names

MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPTS = [[11, 12, 13, 14, 15, 16, 17, 18] * 3, list(range(40, 60)), [60, 61, 62]]
# Output projections of every layer (the target's and, copied, the head's), scaled down.
OUTPUTS = ("o_proj.weight", "out_proj.weight", "down_proj.weight")
TARGET_OUTPUT_SCALE = 0.3
EMBED_RMS = 4.0  # so that the embedding outweighs what the layers add
HEAD_NOISE = 0.3
ONE_ULP = 2.0**-23  # float32's spacing at 1.0
SPEC = {"method": "mtp", "num_speculative_tokens": 2}
# case -> (architecture, converter --outtype)
CASES = {
    "qwen35": ("Qwen3_5ForCausalLM", "f32"),
    "qwen3next": ("Qwen3NextForCausalLM", "f32"),
    "qwen3next_q8_0": ("Qwen3NextForCausalLM", "q8_0"),
}


@pytest.fixture(autouse=True)
def _tokenizer_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENWISE_GGUF_CACHE", str(tmp_path / "tokenizers"))


def counting_with_mtp_head(path: str, out: Path) -> str:
    """A copy of a checkpoint made to count (mostly) and given an MTP head that predicts it,
    as published checkpoints carry a head (`mtp.*`): see the module docstring."""
    tensors = load_file(f"{path}/model.safetensors")
    gen = torch.Generator().manual_seed(5)
    embed = torch.randn(tensors["model.embed_tokens.weight"].shape, generator=gen)
    hidden = embed.shape[1]
    embed = EMBED_RMS * hidden**0.5 * embed / embed.norm(dim=-1, keepdim=True)
    tensors["model.embed_tokens.weight"] = embed
    tensors["lm_head.weight"] = torch.roll(embed, 1, dims=0)  # row v: the embedding of v - 1
    tensors["model.norm.weight"] = torch.zeros(hidden)  # zero-centred: a scale of one
    for name, t in tensors.items():
        if name.endswith(OUTPUTS):
            t.mul_(TARGET_OUTPUT_SCALE)
    last = "model.layers.3."  # the full-attention layer
    for name, t in list(tensors.items()):
        if name.startswith(last):  # a noisy copy; its output projections as they are
            noise = 0 if name.endswith(OUTPUTS) else 0.05 * torch.randn(t.shape, generator=gen)
            tensors["mtp.layers.0." + name[len(last) :]] = t + noise
    noise = HEAD_NOISE * torch.randn(hidden, hidden, generator=gen)
    passed = EMBED_RMS * torch.eye(hidden) + noise  # the next token's embedding, mostly
    tensors["mtp.fc.weight"] = torch.cat([passed, noise.T], dim=1)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{norm}.weight"] = 0.02 * torch.randn(hidden, generator=gen)
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"))
    for item in Path(path).iterdir():
        if item.name != "model.safetensors":
            shutil.copy(item, out / item.name)
    return str(out)


def convert_all(jobs: list[tuple[str, str, str]]) -> None:
    """Run the converter on each `(checkpoint, GGUF file, --outtype)`, all at once (each run
    is mostly one process's Python start-up and imports)."""
    runs = []
    for hf_dir, out, outtype in jobs:
        cmd = [sys.executable, "-c", CONVERT, str(_converter_source()), hf_dir]
        cmd += ["--outtype", outtype, "--outfile", out]
        runs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    for run in runs:
        _, err = run.communicate(timeout=600)
        assert run.returncode == 0, err.decode()[-2000:]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str]]:
    """case -> (checkpoint directory with the head, the converter's GGUF file of it)."""
    if _converter_source() is None:
        skip_or_fail_in_ci(
            "llama.cpp's converter is not at hand: `make test` fetches it "
            "(python -m tokenwise.tools.llamacpp_source), or set LLAMACPP_SOURCE"
        )
    root = tmp_path_factory.mktemp("mtp-gguf")
    out: dict[str, tuple[str, str]] = {}
    for case, (arch, _) in CASES.items():
        hf_dir = root / arch / "mtp"
        if not hf_dir.exists():
            counting_with_mtp_head(build_tiny_checkpoint(root / arch / "base", arch), hf_dir)
        out[case] = (str(hf_dir), str(root / f"{case}.gguf"))
    convert_all([(*out[case], outtype) for case, (_, outtype) in CASES.items()])
    return out


def make(path: str, **kwargs: Any) -> LLM:
    return LLM(path, dtype="float32", block_size=16, num_gpu_blocks=64, **kwargs)


def generate(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def head_of(llm: LLM) -> torch.nn.Module:
    return llm.llm_engine.drafter.draft_model.runner.model


def test_the_converter_wrote_the_head_as_nextn_blocks(files: dict) -> None:
    """What the loader reads: the block after the decoder, counted by nextn_predict_layers."""
    reader = gguf.GGUFReader(files["qwen35"][1])
    assert reader.fields["qwen35.nextn_predict_layers"].contents() == 1
    assert reader.fields["qwen35.block_count"].contents() == 5
    names = {t.name for t in reader.tensors}
    assert {
        "blk.4.nextn.eh_proj.weight",
        "blk.4.nextn.enorm.weight",
        "blk.4.attn_q.weight",
    } <= names


@pytest.mark.parametrize("case", ["qwen35", "qwen3next"])
def test_head_from_the_file_holds_the_directorys_tensors(files: dict, case: str) -> None:
    """Tensor by tensor, after the converter's rewrites (norms plus one, experts stacked):
    bitwise, but for the norms, which the round trip through 1 + w rounds."""
    hf_dir, path = files[case]
    from_file = dict(head_of(make(path, speculative_config=SPEC)).named_parameters())
    from_dir = dict(head_of(make(hf_dir, speculative_config=SPEC)).named_parameters())
    assert sorted(from_file) == sorted(from_dir)
    assert any("experts" in n for n in from_dir) == (case == "qwen3next")
    for name, param in from_dir.items():
        if "norm" in name:  # stored as 1 + w in float32: w within an ulp of 1
            torch.testing.assert_close(from_file[name], param, atol=ONE_ULP, rtol=0)
        else:
            assert torch.equal(from_file[name], param), name


@pytest.fixture(scope="module")
def qwen35_runs(files: dict) -> dict[str, tuple[list[list[int]], Any]]:
    """source -> (greedy tokens, engine stats) for the Qwen3.5 file and directory."""
    hf_dir, path = files["qwen35"]
    runs = {}
    for key, source, spec in (
        ("file", path, None),
        ("file+mtp", path, SPEC),
        ("dir", hf_dir, SPEC),
    ):
        llm = make(source, speculative_config=spec)
        runs[key] = (generate(llm), llm.llm_engine.get_stats())
    return runs


def test_greedy_with_the_files_head_is_lossless_and_drafts_as_the_directorys(
    qwen35_runs: dict,
) -> None:
    plain, _ = qwen35_runs["file"]
    tokens, stats = qwen35_runs["file+mtp"]
    dir_tokens, dir_stats = qwen35_runs["dir"]
    assert tokens == plain == dir_tokens
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    for field in ("num_drafts", "num_draft_tokens", "num_accepted_tokens_per_pos"):
        assert getattr(stats, f"spec_decode_{field}") == getattr(dir_stats, f"spec_decode_{field}")


def test_q8_0_head_runs_on_the_files_integers_and_is_lossless(files: dict) -> None:
    """The head's linear layers take the quantized path the target's take (the file's Q8_0
    integers, the dense weight dropped); output stays the file's own greedy output."""
    _, path = files["qwen3next_q8_0"]
    llm = make(path, speculative_config=SPEC)
    quantized = quantized_layer_names(head_of(llm))
    assert {"fc", "layers.0.self_attn.qkv_proj", "layers.0.self_attn.o_proj"} <= set(quantized)
    tokens, stats = generate(llm), llm.llm_engine.get_stats()
    assert tokens == generate(make(path))
    assert stats.spec_decode_num_accepted_tokens > 0


def test_a_file_without_the_head_is_refused_naming_the_option_and_file(tmp_path: Path) -> None:
    hf_dir = build_tiny_checkpoint(tmp_path / "ckpt", "Qwen3_5ForCausalLM")
    path = write_hybrid_gguf(hf_dir, str(tmp_path / "no-head.gguf"))  # as --no-mtp writes it
    with pytest.raises(
        ValueError,
        match=r"speculative_config\.method 'mtp' needs an MTP head, and GGUF file "
        r"'.*no-head\.gguf' has none \(qwen35\.nextn_predict_layers",
    ):
        make(path, speculative_config=SPEC)


def test_a_file_of_another_family_is_refused_naming_the_option_and_file(tmp_path: Path) -> None:
    hf_dir = build_tiny_checkpoint(tmp_path / "ckpt", "Qwen3ForCausalLM")
    path = write_gguf(hf_dir, str(tmp_path / "qwen3.gguf"))
    with pytest.raises(
        ValueError,
        match=r"speculative_config\.method 'mtp' runs the MTP head of Qwen3\.5, Qwen3\.5-MoE and "
        r"Qwen3-Next GGUF files .*; GGUF file '.*qwen3\.gguf' is a 'qwen3' model",
    ):
        make(path, speculative_config=SPEC)
