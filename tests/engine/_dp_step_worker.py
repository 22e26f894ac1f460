"""Entry point of the spawned DP ranks of test_dp_step_coordination.py.

Each rank builds a whole MoE engine (micro-batching on) and steps it in lock-step with the
other rank, as `engine.core_process` does: a rank with work runs `step()`, an idle one a dummy batch.
Around every step it counts the DP coordination collectives (the `[5, dp_size]` int32 SUM
all-reduce of `dp_coordination`) and calls of `coordinate_batch_across_dp` (what
`set_forward_context` runs when it is not handed counts), and records every DP count vector
the forward contexts received. Reports are plain Python values.
"""

from __future__ import annotations

import traceback
from typing import Any

# Similar sizes on both ranks, so that steps split: the rule needs half the largest rank's
# count to stay below the smallest's (decodes: 4 and 3 tokens, split at 2).
PROMPTS = [
    ["The quick brown fox jumps over", "Hello there, my friend", "Once upon a time", "abc"],
    ["The cat sat on the mat and", "Tensor parallel engines", "A long time ago"],
]
MAX_TOKENS = [4, 2]  # rank 1 finishes first and then runs dummy batches
MAX_ITERATIONS = 100  # a bound: the run needs about a dozen


def run_rank(rank: int, port: int, results: Any) -> None:
    try:
        results.put((rank, _run(rank, port)))
    except BaseException:
        results.put((rank, {"error": traceback.format_exc()}))


def _run(rank: int, port: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from tests.engine._fixtures import checkpoint
    from tokenwise.distributed import dp_coordination, get_dp_group, init_dp_group
    from tokenwise.engine.llm_engine import LLMEngine
    from tokenwise.entrypoints.llm import build_engine_config
    from tokenwise.forward_context import DPMetadata
    from tokenwise.sampling.params import SamplingParams

    torch.set_num_threads(1)
    matrices = [0]
    all_reduce = dist.all_reduce

    def counting_all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if tensor.dtype == torch.int32 and tuple(tensor.shape) == (5, 2):
            matrices[0] += 1
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting_all_reduce
    fallback = [0]
    coordinate = dp_coordination.coordinate_batch_across_dp

    def counting_coordinate(*args: Any, **kwargs: Any) -> Any:
        fallback[0] += 1
        return coordinate(*args, **kwargs)

    dp_coordination.coordinate_batch_across_dp = counting_coordinate
    seen: list[list[int]] = []
    make = DPMetadata.make

    def recording_make(parallel: Any, num_tokens: int, across: Any) -> DPMetadata:
        seen.append(across.tolist())
        return make(parallel, num_tokens, across)

    DPMetadata.make = staticmethod(recording_make)  # type: ignore[method-assign]

    config = build_engine_config(
        checkpoint("MixtralForCausalLM"),
        dtype="float32",
        data_parallel_size=2,
        enable_expert_parallel=True,
        enable_microbatching=True,
        microbatching_token_threshold=2,
    )
    config.parallel.data_parallel_rank = rank
    init_dp_group(config.parallel, "127.0.0.1", port, 60.0, "cpu")
    engine = LLMEngine(config, "cpu")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS[rank], ignore_eos=True)
    for i, prompt in enumerate(PROMPTS[rank]):
        engine.add_request(f"r{i}", prompt, params)
    start = matrices[0]  # start-up's own collectives are not steps
    steps: list[tuple[str, int, int]] = []  # (kind, coordinations, micro-batched passes)
    for _ in range(MAX_ITERATIONS):
        local = engine.has_unfinished_requests()
        flags = torch.tensor([int(local)], dtype=torch.int32)
        all_reduce(flags, group=get_dp_group())
        if not int(flags[0]):
            break
        before, ubatched = matrices[0], engine.runner.num_ubatched_steps
        if local:
            engine.step()
        else:
            engine.execute_dummy_batch()
        kind = "step" if local else "dummy"
        ubatched = engine.runner.num_ubatched_steps - ubatched
        steps.append((kind, matrices[0] - before, ubatched))
    else:
        raise RuntimeError(f"the ranks still had work after {MAX_ITERATIONS} iterations")
    return {
        "steps": steps,
        "outside_steps": matrices[0] - start - sum(n for _, n, _ in steps),
        "fallback_coordinations": fallback[0],
        "dp_counts_seen": seen,
    }
