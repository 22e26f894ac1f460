"""Shared helpers for engine and entrypoint tests: checkpoints, prompts and HF references.

Everything here is cached per process (`lru_cache`), so modules that need the same tiny
checkpoint or the same Hugging Face greedy continuation compute it once. Expected values come
from transformers (`generate(do_sample=False)` with raw logits), never from tokenwise.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from functools import cache, lru_cache
from typing import Any

import torch

from tests.tiny_checkpoints import build_tiny_checkpoint, tiny_tokenizer

LLAMA = "LlamaForCausalLM"
BLOCK_SIZE = 16
SHARED_PREFIX_LEN = 40
# A small explicit KV pool: plenty for every batch these tests run (the largest needs ~60
# blocks) without zero-filling the 1 GiB CPU default for each engine a test builds.
NUM_BLOCKS = 256

_TMP_DIR: str | None = None


def _tmp_dir() -> str:
    global _TMP_DIR
    if _TMP_DIR is None:
        _TMP_DIR = tempfile.mkdtemp(prefix="tokenwise-engine-tests-")
        atexit.register(shutil.rmtree, _TMP_DIR, True)
    return _TMP_DIR


@cache
def checkpoint(arch: str = LLAMA, **overrides: Any) -> str:
    """A tiny checkpoint directory shared by the whole process. Do not modify it; tests that
    edit files should call `build_tiny_checkpoint(tmp_path, ...)` for a private copy."""
    return build_tiny_checkpoint(tempfile.mkdtemp(dir=_tmp_dir()), arch, **overrides)


@cache
def hf_model(path: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def tokenizer() -> Any:
    return tiny_tokenizer()


@cache
def _hf_generate(
    path: str, prompt: tuple[int, ...], max_new_tokens: int, eos: int | None, min_new_tokens: int
) -> tuple[int, ...]:
    model = hf_model(path)
    kwargs: dict[str, Any] = {"do_sample": False, "max_new_tokens": max_new_tokens}
    if eos is None:
        kwargs["eos_token_id"] = None  # ignore_eos: generate exactly max_new_tokens
    elif eos >= 0:
        kwargs["eos_token_id"] = eos
    if min_new_tokens:
        kwargs["min_new_tokens"] = min_new_tokens
    with torch.no_grad():
        out = model.generate(torch.tensor([list(prompt)]), **kwargs)
    tokens = tuple(out[0, len(prompt) :].tolist())
    if eos is None:
        assert len(tokens) == max_new_tokens, "HF stopped early although EOS was disabled"
    return tokens


def hf_greedy(path: str, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF greedy continuation of one unpadded prompt, ignoring EOS (as `ignore_eos=True`)."""
    return list(_hf_generate(path, tuple(prompt), max_new_tokens, None, 0))


def hf_greedy_until(
    path: str,
    prompt: list[int],
    max_new_tokens: int,
    stop_token: int = -1,
    min_new_tokens: int = 0,
) -> list[int]:
    """HF greedy continuation that ends at (and includes) `stop_token`, the checkpoint's EOS
    by default; `min_new_tokens` bans the stop token until that many tokens exist."""
    return list(_hf_generate(path, tuple(prompt), max_new_tokens, stop_token, min_new_tokens))


@cache
def _hf_step_logprobs(path: str, prompt: tuple[int, ...], steps: int) -> tuple[torch.Tensor, ...]:
    model = hf_model(path)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([list(prompt)]),
            do_sample=False,
            max_new_tokens=steps,
            eos_token_id=None,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return tuple(torch.log_softmax(logits[0].float(), dim=-1) for logits in out.logits)


def hf_step_logprobs(path: str, prompt: list[int], steps: int) -> list[torch.Tensor]:
    """log_softmax of HF's raw logits at each of the first `steps` greedy steps."""
    return list(_hf_step_logprobs(path, tuple(prompt), steps))


def random_ids(generator: torch.Generator, n: int) -> list[int]:
    """`n` ordinary token ids; ids >= 2 skip the special tokens (EOS = 0, BOS = 1)."""
    return torch.randint(2, len(tokenizer()), (n,), generator=generator).tolist()


@lru_cache(maxsize=1)
def _mixed_prompts() -> tuple[tuple[int, ...], ...]:
    tok = tokenizer()
    g = torch.Generator().manual_seed(20240601)
    shared = random_ids(g, SHARED_PREFIX_LEN)
    dup = random_ids(g, 2 * BLOCK_SIZE)
    prompts = [
        tok.encode("The"),  # a single token
        tok.encode("Hello world!"),
        tok.encode("def fibonacci(n):\n    return"),
        tok.encode("Once upon a time there was a tiny model that predicted"),
        random_ids(g, 15),
        random_ids(g, BLOCK_SIZE),  # exactly one block
        random_ids(g, BLOCK_SIZE + 1),
        dup,  # two full blocks ...
        shared + random_ids(g, 1),  # four prompts sharing a 40-token prefix ...
        shared + random_ids(g, 4),
        shared,  # ... one of which is the bare prefix
        shared + random_ids(g, 24),
        random_ids(g, 33),
        random_ids(g, 57),
        list(dup),  # ... and the same prompt again (every full block is a cache hit)
        random_ids(g, 95),
        tok.encode("Paged attention stores keys and values in fixed-size blocks of memory."),
        random_ids(g, 7),
    ]
    return tuple(tuple(p) for p in prompts)


def mixed_prompts() -> list[list[int]]:
    """18 token-id prompts of 1 to 95 tokens: block-boundary lengths, a duplicate pair, and four
    prompts sharing a 40-token prefix (one of them is the bare prefix)."""
    return [list(p) for p in _mixed_prompts()]


def assert_pool_clean(engine: Any) -> None:
    """No request left, every block free with ref count 0, block manager invariants hold."""
    bm = engine.block_manager
    assert not engine.has_unfinished_requests()
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert bm.get_num_free_blocks() == bm.num_blocks
    assert [bm.get_ref_count(b) for b in range(bm.num_blocks)] == [0] * bm.num_blocks
    # Encoder-decoder engines: no request holds cross-attention blocks either (the free
    # count above covers both caches, which share the pool).
    assert getattr(bm, "num_cross_tables", 0) == 0
    # Recurrent-state models: every state slot free too (snapshots stay cached, unheld).
    state_pool = getattr(bm, "state_pool", None)
    if state_pool is not None:
        assert state_pool.num_free == state_pool.num_blocks
    bm.check_invariants()
