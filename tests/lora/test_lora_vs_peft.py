"""LoRA serving against Hugging Face + PEFT on tiny Llama and Qwen3 checkpoints.

Adapters are made with `peft` itself (`init_lora_weights=False`, so B is not zero and the
adapter changes the output), saved with `save_pretrained`, and served from those directories.
The reference for each adapter is HF's greedy `generate` on the PEFT-wrapped model; the base
model's reference is plain HF. `test_adapters_change_the_tokens` shows the references differ,
so equality here means each token ran with its own adapter.
"""

from __future__ import annotations

import os
from functools import cache
from typing import Any

import pytest
import torch

from tests.engine._fixtures import assert_pool_clean, checkpoint, mixed_prompts
from tokenwise import LLM, LoRARequest, SamplingParams

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (rank, alpha, target modules, rsLoRA)
ADAPTERS: dict[str, tuple[int, int, list[str], bool]] = {
    "all-r8": (8, 16, ALL_TARGETS, False),
    "attn-r4": (4, 4, ["q_proj", "v_proj", "o_proj"], False),
    "mlp-r2-rslora": (2, 3, ["gate_proj", "down_proj"], True),
}


@cache
def adapter_dir(arch: str, name: str) -> str:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    rank, alpha, targets, rslora = ADAPTERS[name]
    base = checkpoint(arch)
    torch.manual_seed(len(name))
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=targets,
        init_lora_weights=False,
        use_rslora=rslora,
    )
    peft_model = get_peft_model(model, config)
    out = os.path.join(os.path.dirname(base), f"lora-{arch}-{name}")
    peft_model.save_pretrained(out)
    return out


@cache
def peft_greedy(arch: str, name: str | None, prompt: tuple[int, ...]) -> list[int]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint(arch), dtype=torch.float32)
    if name is not None:
        model = PeftModel.from_pretrained(model, adapter_dir(arch, name))
    model.eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=MAX_TOKENS,
            min_new_tokens=MAX_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def adapter_with_unknown_target(arch: str, tmp_path: Any) -> str:
    """A copy of a good adapter whose q_proj tensors are renamed qq_proj (no such module)."""
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(adapter_dir(arch, "attn-r4"), bad)
    weights = load_file(bad / "adapter_model.safetensors")
    renamed = {k.replace("q_proj", "qq_proj"): v for k, v in weights.items()}
    save_file(renamed, bad / "adapter_model.safetensors")
    return str(bad)


def request(arch: str, name: str) -> LoRARequest:
    return LoRARequest(name, list(ADAPTERS).index(name) + 1, adapter_dir(arch, name))


def _prompts() -> list[list[int]]:
    return [mixed_prompts()[i] for i in (1, 4, 9, 13, 16)]


def _tokens(outputs: list[Any]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_one_batch_mixing_adapters_and_the_base_equals_peft(arch: str) -> None:
    """Every prompt under each of two adapters and the base model, all in the same steps."""
    llm = LLM(checkpoint(arch), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8)
    prompts = _prompts()
    names: list[str | None] = ["all-r8", "attn-r4", None]
    batch = [(p, n) for p in prompts for n in names]
    loras = [None if n is None else request(arch, n) for _, n in batch]
    got = _tokens(llm.generate([p for p, _ in batch], GREEDY, use_tqdm=False, lora_request=loras))
    want = [peft_greedy(arch, n, tuple(p)) for p, n in batch]
    assert got == want
    assert llm.llm_engine.runner.lora_manager.num_slot_loads == 2  # both stayed in their slots
    assert_pool_clean(llm.llm_engine)


def test_adapters_change_the_tokens() -> None:
    arch, prompt = "LlamaForCausalLM", tuple(_prompts()[2])
    outputs = {name: peft_greedy(arch, name, prompt) for name in [None, *ADAPTERS]}
    assert len({tuple(v) for v in outputs.values()}) == len(outputs), outputs


def test_more_adapters_than_slots_take_turns() -> None:
    """Three adapters through one slot: the scheduler runs one adapter at a time (never two in
    a step) and the slot is reloaded as adapters come and go, least recently used first."""
    arch = "LlamaForCausalLM"
    llm = LLM(checkpoint(arch), dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=8)
    prompts = _prompts()[:3]
    batch = [(p, n) for n in ADAPTERS for p in prompts] + [(prompts[0], None)]
    loras = [None if n is None else request(arch, n) for _, n in batch]
    got = _tokens(llm.generate([p for p, _ in batch], GREEDY, use_tqdm=False, lora_request=loras))
    assert got == [peft_greedy(arch, n, tuple(p)) for p, n in batch]
    assert llm.llm_engine.runner.lora_manager.num_slot_loads >= len(ADAPTERS)
    assert_pool_clean(llm.llm_engine)


def test_prefix_cache_never_crosses_adapters() -> None:
    arch = "LlamaForCausalLM"
    llm = LLM(checkpoint(arch), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8)
    prompt = mixed_prompts()[16]  # 64+ tokens: several full blocks

    def cached(lora: LoRARequest | None) -> int:
        out = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora)[0]
        return out.num_cached_tokens

    a, b = request(arch, "all-r8"), request(arch, "attn-r4")
    assert cached(a) == 0
    assert cached(b) == 0, "adapter B must not reuse adapter A's blocks"
    assert cached(None) == 0, "the base model must not reuse an adapter's blocks"
    assert cached(a) > 0 and cached(b) > 0 and cached(None) > 0  # each hits its own


def test_bad_adapters_fail_their_request_with_clear_errors(tmp_path: Any) -> None:
    arch = "LlamaForCausalLM"
    llm = LLM(checkpoint(arch), dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=4)
    with pytest.raises(ValueError, match="rank 8, above max_lora_rank=4"):
        llm.generate([[5, 6]], GREEDY, use_tqdm=False, lora_request=request(arch, "all-r8"))
    with pytest.raises(ValueError, match="no adapter_config.json"):
        llm.generate([[5, 6]], GREEDY, lora_request=LoRARequest("x", 9, str(tmp_path)))
    bad = adapter_with_unknown_target(arch, tmp_path)
    with pytest.raises(ValueError, match="qq_proj.*does not have"):
        llm.generate([[5, 6]], GREEDY, use_tqdm=False, lora_request=LoRARequest("b", 7, bad))
    # The engine still serves, and no LoRA engine means a clear refusal.
    ok = llm.generate([[5, 6]], GREEDY, use_tqdm=False, lora_request=request(arch, "attn-r4"))
    assert _tokens(ok) == [peft_greedy(arch, "attn-r4", (5, 6))]
    assert_pool_clean(llm.llm_engine)
    plain = LLM(checkpoint(arch), dtype="float32")
    with pytest.raises(ValueError, match="without LoRA support"):
        plain.generate([[5, 6]], GREEDY, lora_request=request(arch, "attn-r4"))


def test_tensor_parallel_shards_the_adapters() -> None:
    """TP=2: column-parallel layers keep A whole and half of B's rows, row-parallel ones half of
    A's columns (their partial sums ride the layer's all-reduce); tokens still equal PEFT's."""
    arch = "Qwen3ForCausalLM"
    llm = LLM(
        checkpoint(arch),
        dtype="float32",
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        tensor_parallel_size=2,
    )
    try:
        prompts = _prompts()[:3]
        batch = [(p, n) for p in prompts for n in ("all-r8", "mlp-r2-rslora", None)]
        loras = [None if n is None else request(arch, n) for _, n in batch]
        outputs = llm.generate([p for p, _ in batch], GREEDY, use_tqdm=False, lora_request=loras)
        assert _tokens(outputs) == [peft_greedy(arch, n, tuple(p)) for p, n in batch]
        layer = llm.llm_engine.runner.model.model.layers[0]
        hidden = layer.self_attn.qkv_proj.input_size
        assert layer.self_attn.qkv_proj.lora.lora_a.shape[1] == hidden  # A whole
        assert layer.self_attn.o_proj.lora.lora_a.shape[1] == layer.self_attn.o_proj.input_size
        assert layer.self_attn.o_proj.input_size * 2 == layer.self_attn.o_proj.full_input_size
    finally:
        llm.shutdown()
