"""DeepSeek-V2 / V3 (multi-head latent attention) under tensor parallelism, through the engine.

A driver and a spawned worker each hold half of the attention heads (q / q_b and kv_b sliced
by heads, o_proj by input columns) but the whole latent path (kv_a_proj_with_mqa, q_a_proj and
their norms), so each rank caches the full `kv_lora_rank + qk_rope_head_dim` latent of every
token and absorbs / expands it with its own heads. Greedy tokens and logprobs must be
transformers' (fp32, 1e-4) with prompts prefilled in chunks beside decodes, prefix-cache hits
and preemptions, and every block must be free afterwards. The MoE layers run both ways:
V2 with every expert's intermediate dimension split over the ranks, V3 (with the
`q_lora_rank` bottleneck) with whole experts per rank (expert parallelism).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.engine._fixtures import (
    assert_pool_clean,
    checkpoint,
    hf_greedy,
    hf_step_logprobs,
    mixed_prompts,
)
from tokenwise import LLM, SamplingParams
from tokenwise.attention.mla import MLAAttention

MAX_TOKENS = 6
TP = 2
# name -> (arch, checkpoint overrides, engine options)
CASES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "v2-q-proj-sliced-experts": ("DeepseekV2ForCausalLM", {}, {}),
    "v3-q-lora-expert-parallel": (
        "DeepseekV3ForCausalLM",
        {"q_lora_rank": 24},
        {"enable_expert_parallel": True},
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_mla_gives_hf_tokens_and_logprobs_under_chunking_and_preemption(case: str) -> None:
    arch, overrides, options = CASES[case]
    path = checkpoint(arch, **overrides)
    # 8 blocks of 16 tokens and 16-token steps: long prompts are prefilled in pieces beside
    # decodes, and decodes that need a block preempt others.
    llm = LLM(
        path,
        dtype="float32",
        tensor_parallel_size=TP,
        num_gpu_blocks=8,
        max_model_len=128,
        max_num_batched_tokens=16,
        **options,
    )
    try:
        _assert_driver_holds_its_heads_and_the_whole_latent(llm, path, options)
        prompts = mixed_prompts()
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        for prompt, out in zip(prompts, outputs, strict=True):
            assert out.outputs[0].token_ids == hf_greedy(path, prompt, MAX_TOKENS), case
        longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
        ref = hf_step_logprobs(path, prompts[longest], MAX_TOKENS)
        completion = outputs[longest].outputs[0]
        assert len(completion.logprobs) == MAX_TOKENS
        for step, entry in enumerate(completion.logprobs):
            for tid, lp in entry.items():
                assert lp.logprob == pytest.approx(ref[step][tid].item(), abs=1e-4), (case, step)
        stats = llm.llm_engine.get_stats()
        assert stats.num_preemptions_total > 0
        assert stats.num_free_blocks == stats.num_total_blocks
        assert_pool_clean(llm.llm_engine)
    finally:
        llm.shutdown()


def _assert_driver_holds_its_heads_and_the_whole_latent(
    llm: LLM, path: str, options: dict[str, Any]
) -> None:
    """Per-head weights are halves, the latent path and the cache rows are whole."""
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(path)
    heads, local = hf.num_attention_heads, hf.num_attention_heads // TP
    qk = hf.qk_nope_head_dim + hf.qk_rope_head_dim
    latent = hf.kv_lora_rank + hf.qk_rope_head_dim
    model = llm.llm_engine.runner.model
    for layer in model.model.layers:
        attn = layer.self_attn
        q = attn.q_proj if hf.q_lora_rank is None else attn.q_b_proj
        assert tuple(q.weight.shape) == (local * qk, hf.q_lora_rank or hf.hidden_size)
        if hf.q_lora_rank is not None:  # the bottleneck itself is replicated
            assert tuple(attn.q_a_proj.weight.shape) == (hf.q_lora_rank, hf.hidden_size)
        kv_b = (local * (hf.qk_nope_head_dim + hf.v_head_dim), hf.kv_lora_rank)
        assert tuple(attn.kv_b_proj.weight.shape) == kv_b
        assert tuple(attn.o_proj.weight.shape) == (hf.hidden_size, local * hf.v_head_dim)
        assert tuple(attn.kv_a_proj_with_mqa.weight.shape) == (latent, hf.hidden_size)
        assert attn.attn.dims.num_heads == local < heads
    runner = llm.llm_engine.runner
    mla_layers = [lay for lay in runner.attn_layers.values() if isinstance(lay, MLAAttention)]
    assert len(mla_layers) == hf.num_hidden_layers
    for layer in mla_layers:
        cache = layer.kv_cache[0]
        assert isinstance(cache, torch.Tensor) and cache.shape[-1] == latent
    # The MoE layers are sharded too: whole experts per rank, or half of every expert.
    experts = model.model.layers[-1].mlp.experts
    if options.get("enable_expert_parallel"):
        assert experts.w13_weight.shape[0] == hf.n_routed_experts // TP
    else:
        assert experts.w2_weight.shape[-1] == hf.moe_intermediate_size // TP
    shared = model.model.layers[-1].mlp.shared_experts
    assert shared.down_proj.weight.shape[1] == hf.n_shared_experts * hf.moe_intermediate_size // TP
