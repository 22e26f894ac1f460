"""Engines of several tiny families, plain and tensor-, data- and pipeline-parallel, built and
dropped one after another in one process (as a notebook or a benchmark script does): each must
give transformers' greedy tokens, and leave no worker process, process group or TP / PP state
behind for the next. Before the fix a plain engine built after a dropped TP=2 engine read the
stale TP size, joined the dead engine's collective and waited forever; the whole test is
bounded by its timeout instead.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import pytest

from tests.distributed._leftovers import assert_nothing_left, child_processes
from tests.engine._fixtures import checkpoint, hf_greedy
from tokenwise import LLM, SamplingParams
from tokenwise.engine.llm_engine import LLMEngine
from tokenwise.entrypoints.engine_args import build_engine_config

MAX_TOKENS = 4
PROMPT = [5, 17, 42, 99, 7, 3, 61]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# A KV budget rather than a block count: the ranks then agree on their blocks (the collective
# the reported hang waited in). 2 MiB holds far more than one sequence of these models.
KV_BYTES = 2 * 2**20

# (architecture, parallel settings, how the engine goes away). PP runs the Llama family only.
SEQUENCE: list[tuple[str, dict[str, Any], str]] = [
    ("MixtralForCausalLM", {}, "del"),
    ("MixtralForCausalLM", {"tensor_parallel_size": 2}, "del"),
    ("Qwen2MoeForCausalLM", {}, "del"),  # hung, before the fix, after the dropped TP engine
    ("Gemma2ForCausalLM", {"tensor_parallel_size": 2}, "engine-del"),
    ("DeepseekV2ForCausalLM", {}, "shutdown"),  # hung likewise
    ("Gemma2ForCausalLM", {"data_parallel_size": 2}, "shutdown"),
    ("LlamaForCausalLM", {"pipeline_parallel_size": 2}, "del"),
    ("Qwen2MoeForCausalLM", {}, "del"),
]


def _llm_tokens(llm: LLM) -> list[int]:
    out = llm.generate([{"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def _engine_tokens(engine: LLMEngine) -> list[int]:
    """The engine's step outputs carry each step's new tokens: gather them to the end."""
    engine.add_request("r", {"prompt_token_ids": PROMPT}, GREEDY)
    deadline = time.monotonic() + 60
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine did not finish one short request"
        for out in engine.step():
            tokens.extend(out.outputs[0].token_ids)
    return tokens


@pytest.mark.timeout(300, method="thread")  # a hang blocks in C++: signals wait
def test_engines_one_after_another_leave_nothing_behind() -> None:
    before = child_processes()
    for arch, parallel, ending in SEQUENCE:
        path = checkpoint(arch, num_hidden_layers=4)
        what = f"{arch} {parallel or 'plain'}"
        kwargs = {"dtype": "float32", "kv_cache_memory": KV_BYTES, "max_model_len": 64, **parallel}
        if ending == "engine-del":  # LLMEngine itself, freed by the cyclic collector
            engine = LLMEngine(build_engine_config(path, **kwargs))
            assert _engine_tokens(engine) == hf_greedy(path, PROMPT, MAX_TOKENS), what
            del engine
            gc.collect()
        else:
            llm = LLM(path, **kwargs)
            assert _llm_tokens(llm) == hf_greedy(path, PROMPT, MAX_TOKENS), what
            if parallel.get("tensor_parallel_size", 1) > 1:
                # A second engine beside a live TP engine is refused, naming what it holds.
                with pytest.raises(RuntimeError, match=r"tensor_parallel_size=2.*shut it down"):
                    LLM(checkpoint("Qwen2MoeForCausalLM"), dtype="float32")
            if ending == "shutdown":
                llm.shutdown()
            del llm  # no gc.collect(): dropping the LLM must be enough
        assert_nothing_left(before, what)
