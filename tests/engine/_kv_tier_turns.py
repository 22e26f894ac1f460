"""The conversation pattern the KV-tier tests share: four 100-token prompts A, B, C, D over a
16-block pool (a prompt and its answer take 7 blocks), run A B C A D B, so that A's and B's
cached blocks are evicted by the traffic in between and a returning prompt has to find them
in the tier."""

from __future__ import annotations

import random

from tokenwise import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ORDER = (0, 1, 2, 0, 3, 1)
SMALL = {"dtype": "float32", "num_gpu_blocks": 16, "max_model_len": 256}


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(5, 250) for _ in range(100)] for _ in range(4)]


def run_turns(llm: LLM, order: tuple[int, ...] = ORDER) -> list[list[int]]:
    """Each prompt of `order` alone (one after the other, as turns of a conversation); the
    tier's writes are flushed after each (the user's think time)."""
    all_prompts, engine, outs = prompts(), llm.llm_engine, []
    for i in order:
        out = llm.generate([{"prompt_token_ids": all_prompts[i]}], PARAMS, use_tqdm=False)
        outs.append(list(out[0].outputs[0].token_ids))
        if engine.kv_tier is not None:
            assert engine.kv_tier.store.flush(30)
    return outs
