"""HF parity on the device: one tiny checkpoint per architecture family, greedy tokens (or
embeddings) from the engine on `ctx.device` against transformers' in fp32 on the CPU.

Why the reference runs on the CPU: it is the one the CPU suite already trusts, so a mismatch
here points at the device path (kernels, graphs, dtype handling), not at the reference. The
checkpoints and the HF helpers are the test suite's (tests/tiny_checkpoints.py, tests/models):
what the suite checks on CPU is checked here on the GPU with the same recipes. Engines run
eagerly (the device's attention backend and kernels, no compilation): compiling each family
would cost ~30 s of a 15-minute lease apiece, and graphs have their own part (graph_modes).
"""

from __future__ import annotations

from typing import Any

import torch

from benchmarks.gpu_check_parts.plan import Context, Part


def _llm(ctx: Context, path: str, **kwargs: Any) -> Any:
    from tokenwise import LLM

    kwargs.setdefault("enforce_eager", True)
    return LLM(path, dtype="float32", device=ctx.device, seed=ctx.seed, **kwargs)


def report(ctx: Context, arch: str, got: list[Any], want: list[Any]) -> None:
    """One figure: how many requests gave HF's greedy tokens (ok only when all did)."""
    same = sum(a == b for a, b in zip(got, want, strict=True))
    ctx.figure("greedy_equal_hf", same, "requests", same == len(want), arch=arch, of=len(want))


def causal(ctx: Context, arch: str, **overrides: Any) -> None:
    from tests.engine._fixtures import hf_greedy, mixed_prompts
    from tests.tiny_checkpoints import build_tiny_checkpoint
    from tokenwise import SamplingParams

    path = build_tiny_checkpoint(ctx.workdir, arch, **overrides)
    steps = ctx.size(4, 12)
    prompts = mixed_prompts()[: ctx.size(3, 18)]
    want = [hf_greedy(path, p, steps) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    outs = _llm(ctx, path, num_gpu_blocks=256).generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
    )
    report(ctx, arch, [list(o.outputs[0].token_ids) for o in outs], want)


def bart(ctx: Context) -> None:
    from tests.models import test_bart_vs_hf as t
    from tests.tiny_checkpoints import build_tiny_checkpoint

    path = build_tiny_checkpoint(ctx.workdir, t.ARCH)
    reqs = t.requests(ctx.seed, ctx.size(2, 8))
    got = t.generate(_llm(ctx, path, num_gpu_blocks=96), reqs)
    report(ctx, t.ARCH, got, [t.hf_greedy(path, e, d, t.MAX_TOKENS) for e, d in reqs])


def whisper(ctx: Context) -> None:
    from tests.models import test_whisper_vs_hf as t
    from tests.tiny_checkpoints import build_tiny_checkpoint
    from tokenwise import SamplingParams

    path = build_tiny_checkpoint(ctx.workdir, t.ARCH)
    clips = t.CLIPS[: ctx.size(2, len(t.CLIPS))]
    model, fe = t.hf_parts(path)
    feats = fe(list(clips), sampling_rate=t.RATE, return_tensors="pt").input_features
    with torch.no_grad():
        ref = model.generate(feats, do_sample=False, max_new_tokens=t.MAX_TOKENS)
    eos = model.config.eos_token_id
    prompts = [{"prompt": "", "multi_modal_data": {"audio": (c, t.RATE)}} for c in clips]
    params = SamplingParams(temperature=0.0, max_tokens=t.MAX_TOKENS)
    outs = _llm(ctx, path, num_gpu_blocks=64, block_size=8).generate(
        prompts, params, use_tqdm=False
    )
    got = [t.strip_eos(list(o.outputs[0].token_ids), eos) for o in outs]
    report(ctx, t.ARCH, got, [t.strip_eos(row.tolist(), eos) for row in ref])


def llava(ctx: Context) -> None:
    import os

    from tests.models import test_llava as t
    from tests.models._tiny_llava import build_tiny_llava

    path = build_tiny_llava(os.path.join(ctx.workdir, "llava"))
    cases = t.CASES[: ctx.size(2, len(t.CASES))]
    got = t.run(_llm(ctx, path, num_gpu_blocks=64, block_size=8), cases)
    report(ctx, "LlavaForConditionalGeneration", got, [t.hf_greedy(path, *c) for c in cases])


def bert(ctx: Context) -> None:
    from tests.models import test_bert_vs_hf as t
    from tests.tiny_checkpoints import build_tiny_checkpoint

    path = build_tiny_checkpoint(ctx.workdir, "BertModel")
    want = t.hf_embeddings(path, t.TEXTS, "CLS", True, "BertModel")
    outs = _llm(ctx, path, task="embed").embed(t.TEXTS, use_tqdm=False)
    got = torch.tensor([o.outputs.embedding for o in outs])
    err = float((got - want).abs().max())
    ctx.figure("embedding_max_abs_diff_hf", err, "abs", err <= 1e-4, arch="BertModel")


def _family(*archs: str) -> Any:
    def run(ctx: Context) -> None:
        for arch in archs:
            causal(ctx, arch)

    return run


PARTS = [
    Part("parity_llama", 60, _family("LlamaForCausalLM"), "Llama greedy tokens vs HF"),
    Part("parity_qwen3", 60, _family("Qwen3ForCausalLM"), "Qwen3 (explicit head_dim)"),
    Part("parity_gemma", 90, _family("Gemma2ForCausalLM", "Gemma3ForCausalLM"), "soft caps, SWA"),
    Part("parity_moe", 90, _family("MixtralForCausalLM", "Qwen2MoeForCausalLM"), "fused MoE"),
    Part("parity_deepseek_v2", 60, _family("DeepseekV2ForCausalLM"), "MLA"),
    Part("parity_bart", 60, bart, "encoder-decoder"),
    Part("parity_whisper", 60, whisper, "audio encoder-decoder"),
    Part("parity_llava", 60, llava, "vision tower + projector"),
    Part("parity_bert", 60, bert, "embeddings (task=embed)"),
]
