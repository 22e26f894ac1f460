"""The built-in model: a real checkpoint that transformers and tokenwise both load and agree on."""

from __future__ import annotations

import pytest
import torch

from tokenwise.default_model import DEFAULT_MODEL_DIR, resolve_model_path

PROMPTS = ["def fibonacci(n):", "import os", "class Stack:\n    def __init__(self):", "for i in"]


@pytest.fixture(scope="module")
def hf_greedy() -> list[list[int]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32)
    outs = []
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=20,
                do_sample=False,
                min_new_tokens=20,
                pad_token_id=tok.eos_token_id,
            )
        outs.append(gen[0, ids.shape[1] :].tolist())
    return outs


def test_default_model_is_packaged_and_resolved() -> None:
    assert resolve_model_path(None) == DEFAULT_MODEL_DIR
    assert resolve_model_path("default") == DEFAULT_MODEL_DIR


def test_tokenwise_matches_transformers_on_the_builtin_model(hf_greedy: list[list[int]]) -> None:
    from tokenwise import LLM, SamplingParams

    llm = LLM(dtype="float32", kv_cache_memory=1 << 24)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy


def test_builtin_model_writes_python_looking_text() -> None:
    from tokenwise import LLM, SamplingParams

    llm = LLM(dtype="float32", kv_cache_memory=1 << 24)
    text = (
        llm.generate(
            "def fibonacci(n):", SamplingParams(temperature=0, max_tokens=40), use_tqdm=False
        )[0]
        .outputs[0]
        .text
    )
    # Code-shaped output: a newline followed by indentation, and Python keywords or names.
    assert "\n    " in text
    assert any(word in text for word in ("return", "if", "self", "def", "for", "=", '"""'))
