"""Bad GGUF inputs fail with errors that name the problem; tokenizer choice and CLI flags.

Every error here is raised before or while loading, with the file (and tensor, type or key)
named, because the alternatives (a numpy traceback, a half-loaded model, a silently wrong rope)
are far harder to act on.
"""

from __future__ import annotations

from typing import Any

import gguf
import numpy as np
import pytest

from tests.quantization._gguf_files import write_gguf
from tests.tiny_checkpoints import build_tiny_checkpoint, tiny_tokenizer
from tokenwise import LLM
from tokenwise.entrypoints.cli import build_parser, main
from tokenwise.entrypoints.engine_args import engine_kwargs
from tokenwise.entrypoints.extra_commands import resolve_model_tag
from tokenwise.model_config import ModelConfig

Q = gguf.GGMLQuantizationType


@pytest.fixture(autouse=True)
def _tokenizer_cache(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENWISE_GGUF_CACHE", str(tmp_path / "tokenizers"))


@pytest.fixture
def hf_dir(tmp_path: Any) -> str:
    return build_tiny_checkpoint(tmp_path, "LlamaForCausalLM")


def _llm(path: str, **kwargs: Any) -> LLM:
    return LLM(path, dtype="float32", num_gpu_blocks=64, **kwargs)


def test_missing_file(tmp_path: Any) -> None:
    with pytest.raises(FileNotFoundError, match="GGUF file .*nope.gguf.* does not exist"):
        ModelConfig.from_pretrained(str(tmp_path / "nope.gguf"))


def test_file_that_is_not_gguf(tmp_path: Any) -> None:
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"not a gguf file at all" * 4)
    with pytest.raises(ValueError, match="fake.gguf.* is not a readable GGUF file"):
        ModelConfig.from_pretrained(str(path))


def test_unsupported_architecture(tmp_path: Any) -> None:
    path = str(tmp_path / "mamba.gguf")
    writer = gguf.GGUFWriter(path, "mamba")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        NotImplementedError,
        match="'mamba' model.*gemma2, gemma3, gemma4, gpt-oss, llama, qwen2, qwen2moe, qwen3, "
        "qwen35, qwen35moe, qwen3moe, qwen3next",
    ):
        ModelConfig.from_pretrained(path)


def test_tensor_type_gguf_py_cannot_dequantize(tmp_path: Any, hf_dir: str) -> None:
    int8 = np.ones((64, 64), dtype=np.int8)  # llama.cpp's I8: no dequantizer in gguf-py
    path = write_gguf(
        hf_dir, str(tmp_path / "i8.gguf"), extra_tensors={"blk.0.attn_q.weight": int8}
    )
    with pytest.raises(NotImplementedError, match="blk.0.attn_q.weight.* type I8.*cannot dequant"):
        _llm(path)


def test_tensor_with_no_counterpart(tmp_path: Any, hf_dir: str) -> None:
    extra = {"blk.0.attn_gate.weight": np.zeros((64, 64), dtype=np.float32)}
    path = write_gguf(hf_dir, str(tmp_path / "extra.gguf"), extra_tensors=extra)
    with pytest.raises(ValueError, match="blk.0.attn_gate.weight.* matches no parameter"):
        _llm(path)


@pytest.mark.parametrize(
    ("factors", "problem"),
    [(np.ones(5, dtype=np.float32), "holds 5 factors.*needs 8"), (np.zeros(8, np.float32), "> 0")],
)
def test_bad_rope_frequency_factors_are_refused(
    tmp_path: Any, hf_dir: str, factors: np.ndarray, problem: str
) -> None:
    """A `rope_freqs` tensor (Llama 3.1+ as llama.cpp converts it) needs one positive factor
    per frequency pair of the 16-wide head."""
    path = write_gguf(
        hf_dir, str(tmp_path / "rope.gguf"), extra_tensors={"rope_freqs.weight": factors}
    )
    with pytest.raises(ValueError, match=f"rope_freqs.weight.*{problem}"):
        ModelConfig.from_pretrained(path)


def test_no_tokenizer_metadata_asks_for_a_tokenizer_directory(tmp_path: Any, hf_dir: str) -> None:
    path = write_gguf(hf_dir, str(tmp_path / "bare.gguf"), Q.Q8_0, tokenizer=False)
    with pytest.raises(ValueError, match="cannot build a tokenizer .*--tokenizer"):
        ModelConfig.from_pretrained(path)
    # With a directory (vLLM's form) it runs, tokenizing as that directory does.
    llm = _llm(path, tokenizer=hf_dir)
    (out,) = llm.generate("Hello world!")
    assert out.prompt_token_ids == tiny_tokenizer().encode("Hello world!")
    assert len(out.outputs[0].token_ids) > 0
    # And without any tokenizer, on token ids.
    assert ModelConfig.from_pretrained(path, skip_tokenizer_init=True).load_format == "gguf"


def test_safetensors_load_format_on_a_gguf_file(tmp_path: Any, hf_dir: str) -> None:
    path = write_gguf(hf_dir, str(tmp_path / "m.gguf"))
    with pytest.raises(ValueError, match="is a GGUF file"):
        ModelConfig.from_pretrained(path, load_format="safetensors")


def test_serve_takes_the_model_positionally_with_a_tokenizer_flag() -> None:
    args = build_parser().parse_args(["serve", "m.gguf", "--tokenizer", "tok-dir"])
    args = resolve_model_tag(args)
    assert args.model == "m.gguf"
    assert engine_kwargs(args)["tokenizer"] == "tok-dir"
    clash = build_parser().parse_args(["serve", "a.gguf", "--model", "b.gguf"])
    with pytest.raises(ValueError, match="two models given"):
        resolve_model_tag(clash)


def test_generate_command_on_a_gguf_file(tmp_path: Any, hf_dir: str, capsys: Any) -> None:
    path = write_gguf(hf_dir, str(tmp_path / "cli.gguf"), Q.Q8_0)
    argv = ["generate", "Hello", "--model", path, "--dtype", "float32", "--max-tokens", "4"]
    assert main([*argv, "--num-gpu-blocks", "64"]) == 0
    assert "Hello" in capsys.readouterr().out
    assert main(["generate", "x", "--model", str(tmp_path / "gone.gguf")]) == 2
    assert "gone.gguf' does not exist" in capsys.readouterr().err
