"""BART against Hugging Face: the same logits (fp32, 1e-4) and the same greedy tokens, through
the engine's encoder-decoder path (encoder once per request, cross K/V in a paged cross cache).

References come from transformers' `BartForConditionalGeneration` (`generate(do_sample=False)`,
one unpadded request at a time, or a plain forward pass); the tiny checkpoint has perturbed
norms and biases and scaled embeddings (tests/tiny_checkpoints.py), so a parameter that is not
loaded, a missing scale or BART's position offset shows.
"""

from __future__ import annotations

from functools import cache

import pytest
import torch
import transformers

from tests.engine._fixtures import assert_pool_clean
from tests.tiny_checkpoints import build_tiny_checkpoint
from tokenwise.config import EngineConfig
from tokenwise.entrypoints.llm import LLM, build_engine_config
from tokenwise.loader import load_model
from tokenwise.sampling.params import SamplingParams

ARCH = "BartForConditionalGeneration"
MAX_TOKENS = 12
ATOL = 1e-4


@pytest.fixture(scope="module")
def bart_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("bart"), ARCH)


@cache
def hf_bart(path: str) -> transformers.BartForConditionalGeneration:
    return transformers.BartForConditionalGeneration.from_pretrained(path, dtype=torch.float32)


def hf_greedy(path: str, encoder: list[int], decoder: list[int], steps: int) -> list[int]:
    """HF's greedy tokens after the decoder prompt, EOS ignored (as `ignore_eos=True`)."""
    with torch.no_grad():
        out = (
            hf_bart(path)
            .eval()
            .generate(
                torch.tensor([encoder]),
                decoder_input_ids=torch.tensor([decoder]),
                do_sample=False,
                max_new_tokens=steps,
                eos_token_id=None,
            )
        )
    return out[0, len(decoder) :].tolist()


def requests(seed: int, n: int) -> list[tuple[list[int], list[int]]]:
    """(encoder ids, decoder prompt) pairs of mixed lengths; decoder prompts of 1 to 20 tokens
    that start with BART's decoder start token (EOS = 0 here)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        enc_len = int(torch.randint(1, 40, (1,), generator=g))
        dec_len = [0, 0, 3, 19][i % 4]
        enc = torch.randint(3, 250, (enc_len,), generator=g).tolist()
        dec = [0] + torch.randint(3, 250, (dec_len,), generator=g).tolist()
        out.append((enc, dec))
    return out


def generate(llm: LLM, reqs: list[tuple[list[int], list[int]]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [{"encoder_prompt": e, "decoder_prompt": d} for e, d in reqs]
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def test_model_logits_equal_hf(bart_dir: str) -> None:
    """The model on its own (no engine: one encoder, one decoder sequence) against HF."""
    config = EngineConfig(model=build_engine_config(bart_dir, dtype="float32").model)
    model = load_model(config)
    enc, dec = [5, 17, 33, 80, 121, 7, 9], [0, 44, 12, 250]
    with torch.no_grad():
        hidden = model(
            torch.tensor(dec),
            torch.arange(len(dec)),
            encoder_input_ids=torch.tensor(enc),
            encoder_positions=torch.arange(len(enc)),
        )
        ours = model.compute_logits(hidden)
        ref = (
            hf_bart(bart_dir)
            .eval()(input_ids=torch.tensor([enc]), decoder_input_ids=torch.tensor([dec]))
            .logits[0]
        )
    assert torch.allclose(ours, ref, atol=ATOL), (ours - ref).abs().max()


def test_engine_logprobs_equal_hf(bart_dir: str) -> None:
    """Every step's log-probabilities through the engine (encoder step, then decodes reading
    the cross cache) against HF's forward pass on the same tokens."""
    llm = LLM(bart_dir, dtype="float32", num_gpu_blocks=64)
    enc, dec = [9, 8, 7, 100, 101, 102, 103, 3, 4], [0, 61, 62]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    out = llm.generate({"encoder_prompt": enc, "decoder_prompt": dec}, params, use_tqdm=False)
    completion = out[0].outputs[0]
    full = dec + list(completion.token_ids)
    with torch.no_grad():
        logits = (
            hf_bart(bart_dir)
            .eval()(input_ids=torch.tensor([enc]), decoder_input_ids=torch.tensor([full[:-1]]))
            .logits[0]
        )
    ref = torch.log_softmax(logits.float(), dim=-1)[len(dec) - 1 :]
    for step, entry in enumerate(completion.logprobs):
        for token, lp in entry.items():
            assert abs(lp.logprob - ref[step, token].item()) < ATOL, (step, token)
    assert_pool_clean(llm.llm_engine)


def test_batched_greedy_equals_hf_with_chunked_decoder_prefill(bart_dir: str) -> None:
    """18 requests of mixed encoder and decoder lengths in one batch; a 48-token budget splits
    long decoder prompts over steps (the encoder tokens count against it too)."""
    reqs = requests(1, 18)
    llm = LLM(bart_dir, dtype="float32", num_gpu_blocks=96, max_num_batched_tokens=48)
    got = generate(llm, reqs)
    for (enc, dec), tokens in zip(reqs, got, strict=True):
        assert tokens == hf_greedy(bart_dir, enc, dec, MAX_TOKENS)
    engine = llm.llm_engine
    assert engine.runner.kind_part.num_encoder_runs == len(reqs)  # no preemption here: once each
    assert_pool_clean(engine)


def test_greedy_equals_hf_under_preemption(bart_dir: str) -> None:
    """A pool too small for the batch: requests are preempted (both their tables freed), rerun
    their encoder on resume, and still give HF's tokens; every block is free at the end."""
    reqs = requests(2, 10)
    llm = LLM(bart_dir, dtype="float32", num_gpu_blocks=48, block_size=4, max_model_len=64)
    got = generate(llm, reqs)
    engine = llm.llm_engine
    assert engine.get_stats().num_preemptions_total > 0
    assert engine.runner.kind_part.num_encoder_runs > len(reqs)  # preempted requests encoded again
    for (enc, dec), tokens in zip(reqs, got, strict=True):
        assert tokens == hf_greedy(bart_dir, enc, dec, MAX_TOKENS)
    assert_pool_clean(engine)


def test_default_decoder_prompt_and_text_prompts(bart_dir: str) -> None:
    """No decoder prompt means HF's `[decoder_start_token_id]`; a plain prompt is the encoder's;
    a decoder prompt without the start token gets it prepended (as HF generate does)."""
    llm = LLM(bart_dir, dtype="float32", num_gpu_blocks=64)
    tok = llm.get_tokenizer()
    text = "The quick brown fox"
    enc = tok.encode(text)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate(
        [text, {"encoder_prompt": enc}, {"encoder_prompt": enc, "decoder_prompt": [44, 45]}],
        params,
        use_tqdm=False,
    )
    expected = hf_greedy(bart_dir, enc, [0], 8)
    assert list(outs[0].outputs[0].token_ids) == expected
    assert list(outs[1].outputs[0].token_ids) == expected
    assert outs[2].prompt_token_ids == [0, 44, 45]
    assert list(outs[2].outputs[0].token_ids) == hf_greedy(bart_dir, enc, [0, 44, 45], 8)


def test_bad_prompts_are_refused_by_name(bart_dir: str) -> None:
    llm = LLM(bart_dir, dtype="float32", num_gpu_blocks=64)
    params = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="encoder prompt has 129 tokens.*128 positions"):
        llm.generate({"encoder_prompt": [5] * 129}, params, use_tqdm=False)
    with pytest.raises(ValueError, match="encoder_prompt"):
        llm.generate({"decoder_prompt": [0, 5]}, params, use_tqdm=False)
    with pytest.raises(ValueError, match="takes no audio"):
        audio = {"prompt": "", "multi_modal_data": {"audio": ([0.0] * 10, 16000)}}
        llm.generate({"encoder_prompt": audio}, params, use_tqdm=False)
    with pytest.raises(ValueError, match="out of range"):
        llm.generate({"encoder_prompt": [10**6]}, params, use_tqdm=False)
    # The engine still serves after refusing those.
    out = llm.generate({"encoder_prompt": [5, 6]}, params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    assert_pool_clean(llm.llm_engine)
