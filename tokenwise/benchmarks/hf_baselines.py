"""The Hugging Face baselines `benchmarks/compare_hf.py` measures tokenwise against.

- `run_hf_generate`: `model.generate` on padded batches, as most users call it. Each batch is
  left-padded and runs until its longest request is done; only each request's own output
  length is counted as output, so the padding work shows up as lost throughput.
- `run_hf_batch`: transformers' continuous batching (the manager behind
  `model.generate_batch`), given one `max_new_tokens` per request. Its KV cache must be sized
  explicitly (`hf_num_blocks`): left alone on a CPU it takes 90% of the machine's RAM.

Both run under `torch.no_grad()` (docs/performance.md: continuous batching wants `no_grad`, not
`inference_mode`), ignore EOS and decode greedily. A failure is returned as `EngineRun.error` so
that one broken baseline (transformers' API moves between releases) does not lose the others'
results.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tokenwise.benchmarks.common import BenchRequest
from tokenwise.benchmarks.roofline import ModelShape


@dataclass
class EngineRun:
    """One timed run of one engine over the whole workload (or the error that stopped it)."""

    engine: str
    elapsed: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def hf_batches(
    workload: list[BenchRequest], batch_size: int, pad_id: int = 0
) -> list[tuple[list[list[int]], list[list[int]], int]]:
    """(left-padded ids, attention mask, batch's longest output) per batch, in workload order."""
    batches = []
    for i in range(0, len(workload), batch_size):
        chunk = workload[i : i + batch_size]
        width = max(r.prompt_len for r in chunk)
        ids = [[pad_id] * (width - r.prompt_len) + r.prompt_token_ids for r in chunk]
        mask = [[0] * (width - r.prompt_len) + [1] * r.prompt_len for r in chunk]
        batches.append((ids, mask, max(r.output_len for r in chunk)))
    return batches


def hf_num_blocks(shape: ModelShape, kv_bytes: int, page_size: int, itemsize: int) -> int:
    """HF continuous-batching blocks (page_size tokens of K and V, every layer) in kv_bytes."""
    per_block = 2 * shape.layers * shape.kv_heads * shape.head_dim * page_size * itemsize
    return max(1, kv_bytes // per_block)


def run_hf_generate(model: Any, workload: list[BenchRequest], batch_size: int) -> EngineRun:
    import torch
    from transformers import GenerationConfig

    generated = 0
    start = time.perf_counter()
    for ids, mask, max_new in hf_batches(workload, batch_size):
        config = GenerationConfig(
            do_sample=False, max_new_tokens=max_new, min_new_tokens=max_new,
            eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
        with torch.no_grad():
            out = model.generate(
                input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                generation_config=config,
            )  # fmt: skip
        generated += (out.shape[1] - len(ids[0])) * out.shape[0]
    elapsed = time.perf_counter() - start
    useful = sum(r.output_len for r in workload)
    prompt_tokens = sum(r.prompt_len for r in workload)
    return EngineRun("hf", elapsed, useful, prompt_tokens, extra={"generated_tokens": generated})


def run_hf_batch(model: Any, workload: list[BenchRequest], cb_config: Any) -> EngineRun:
    """transformers' continuous batching, driven like `generate_batch` but with one
    `max_new_tokens` per request (generate_batch takes a single one for all)."""
    import torch
    from transformers import GenerationConfig

    gen = GenerationConfig(do_sample=False, max_new_tokens=max(r.output_len for r in workload))
    gen.eos_token_id = -1  # -1 = no EOS in continuous batching
    try:
        with torch.no_grad(), model.continuous_batching_context_manager(
            generation_config=gen, continuous_batching_config=cb_config, block=True, warmup=False
        ) as manager:  # fmt: skip
            start = time.perf_counter()
            for i, r in enumerate(workload):
                manager.add_request(
                    r.prompt_token_ids, request_id=f"r{i}", max_new_tokens=r.output_len,
                    eos_token_id=-1,
                )  # fmt: skip
            results: dict[str, Any] = {}
            while len(results) < len(workload):
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    if result.error is not None:
                        raise RuntimeError(f"request {result.request_id}: {result.error}")
                    results[result.request_id] = result
                elif result is None and not manager.is_running():
                    raise RuntimeError("the continuous batching thread stopped")
            elapsed = time.perf_counter() - start
    except Exception as exc:  # reported in the table: HF's API changes between releases
        return EngineRun("hf_batch", error=f"{type(exc).__name__}: {exc}"[:200])
    out_tokens = sum(len(r.generated_tokens) for r in results.values())
    return EngineRun("hf_batch", elapsed, out_tokens, sum(r.prompt_len for r in workload))
