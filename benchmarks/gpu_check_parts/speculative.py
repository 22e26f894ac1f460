"""Speculative decoding on the device: n-gram, a draft model and an EAGLE head, at batch 1 and
32. Greedy must be lossless (the tokens of the same engine without speculation) and each run
prints its tokens/s beside the plain run's, with the acceptance it had.

The target is the suite's tiny Llama, the draft another seed of it (same tokenizer), the EAGLE
head tests/spec_decode/eagle_heads.py's: random models accept few drafts, so the speed figures
say what verification costs on this device, not what speculation gains on real text.
`disable_by_batch_size` is above 32 so the batch of 32 speculates too.
"""

from __future__ import annotations

import os
import time
from typing import Any

from benchmarks.gpu_check_parts.plan import Context, Part


def _run(ctx: Context, path: str, spec: dict[str, Any] | None, batch: int) -> tuple[Any, float]:
    from tests.engine._fixtures import mixed_prompts
    from tokenwise import LLM, SamplingParams

    base = mixed_prompts()
    prompts = [{"prompt_token_ids": base[i % len(base)]} for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=ctx.size(4, 48), ignore_eos=True)
    llm = LLM(path, dtype="float32", device=ctx.device, seed=ctx.seed, num_gpu_blocks=512,
              enforce_eager=True, speculative_config=spec)  # fmt: skip
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    spent = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return tokens, sum(map(len, tokens)) / spent


def spec_decode(ctx: Context) -> None:
    from tests.spec_decode.eagle_heads import eagle1_head
    from tests.tiny_checkpoints import build_tiny_checkpoint

    target = build_tiny_checkpoint(ctx.workdir, "LlamaForCausalLM")
    draft = build_tiny_checkpoint(os.path.join(ctx.workdir, "draft"), "LlamaForCausalLM",
                                  seed=1, num_hidden_layers=1)  # fmt: skip
    head = eagle1_head(os.path.join(ctx.workdir, "eagle-head"), target)
    k = 3
    specs = {
        "ngram": {"method": "ngram", "num_speculative_tokens": k},
        "draft_model": {"method": "draft_model", "model": draft, "num_speculative_tokens": k},
        "eagle": {"method": "eagle", "model": head, "num_speculative_tokens": k},
    }
    for batch in (1, ctx.size(2, 32)):
        plain, plain_rate = _run(ctx, target, None, batch)
        ctx.figure(f"plain_batch{batch}", round(plain_rate, 1), "tok/s", batch=batch)
        for name, spec in specs.items():
            spec = {**spec, "disable_by_batch_size": 64}
            tokens, rate = _run(ctx, target, spec, batch)
            same = sum(a == b for a, b in zip(tokens, plain, strict=True))
            ctx.figure(f"{name}_batch{batch}", round(rate, 1), "tok/s", same == len(plain),
                       lossless_requests=same, of=len(plain), k=k,
                       ratio_to_plain=round(rate / plain_rate, 3))  # fmt: skip


PARTS = [Part("spec_decode", 150, spec_decode, "n-gram / draft / EAGLE at batch 1 and 32")]
