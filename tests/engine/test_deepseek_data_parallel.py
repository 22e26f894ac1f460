"""DeepSeek-V3 (MLA + grouped, biased routing) under data and expert parallelism.

Attention and its latent cache are per rank; the routed experts are split over the two ranks
(4 whole experts each) and every MoE layer exchanges tokens. The routing (sigmoid, choice bias,
group limit, scaling) runs after the exchange on every rank's tokens, so a rank that routed
with other rules, or lost the bias, would change the tokens that transformers' `generate`
gives. The sliced-experts form shares all of this with the other MoE models' DP tests.
"""

from __future__ import annotations

from tests.engine._fixtures import checkpoint, hf_greedy, mixed_prompts
from tokenwise import LLM, SamplingParams

MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def test_dp2_expert_parallel_deepseek_v3_gives_hf_tokens() -> None:
    """Whole experts per rank (4 of 8 each): the case where a routing slip shows most."""
    path = checkpoint("DeepseekV3ForCausalLM")
    prompts = mixed_prompts()[:6]
    llm = LLM(path, dtype="float32", data_parallel_size=2, enable_expert_parallel=True,
              num_gpu_blocks=64)  # fmt: skip
    try:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == [
            hf_greedy(path, p, MAX_TOKENS) for p in prompts
        ]
        stats = llm.llm_engine.get_rank_stats()
        assert all(s.generation_tokens_total > 0 for s in stats)  # both ranks served requests
    finally:
        llm.shutdown()
