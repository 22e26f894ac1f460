"""Whisper against Hugging Face: audio in, the same greedy transcription tokens out.

The tiny checkpoint (tests/tiny_checkpoints.py) has 16 mel bins and a 1 s window (100 frames,
50 encoder tokens), with its `WhisperFeatureExtractor` saved beside it. Audio is generated here
(sine sweeps and noise of different lengths); references are HF `generate(input_features=...)`
on features from HF's own feature extractor, so tokenwise's audio path is checked end to end.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import pytest
import torch
import transformers

from tests.engine._fixtures import assert_pool_clean
from tests.tiny_checkpoints import build_tiny_checkpoint
from tokenwise.entrypoints.llm import LLM
from tokenwise.sampling.params import SamplingParams

ARCH = "WhisperForConditionalGeneration"
RATE = 16000
MAX_TOKENS = 12
TASK_PROMPT = "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>"


def sweep(seconds: float, f0: float, f1: float, seed: int = 0) -> np.ndarray:
    """A linear chirp from f0 to f1 Hz with a little noise: distinct audio per argument set."""
    t = np.arange(int(seconds * RATE)) / RATE
    phase = 2 * np.pi * (f0 * t + (f1 - f0) * t**2 / (2 * seconds))
    noise = np.random.default_rng(seed).normal(0, 0.05, t.shape)
    return (0.5 * np.sin(phase) + noise).astype(np.float32)


CLIPS = [
    sweep(0.25, 200, 900),
    sweep(1.0, 3000, 300, 1),
    sweep(0.6, 500, 5000, 2),
    sweep(0.05, 800, 800),
]


@pytest.fixture(scope="module")
def whisper_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("whisper"), ARCH)


@pytest.fixture(scope="module")
def llm(whisper_dir: str) -> LLM:
    return LLM(whisper_dir, dtype="float32", num_gpu_blocks=64, block_size=8)


@cache
def hf_parts(path: str) -> tuple[transformers.WhisperForConditionalGeneration, object]:
    model = transformers.WhisperForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    return model.eval(), transformers.WhisperFeatureExtractor.from_pretrained(path)


def strip_eos(tokens: list[int], eos: int) -> list[int]:
    return tokens[: tokens.index(eos)] if eos in tokens else tokens


def test_batched_greedy_transcription_equals_hf(whisper_dir: str, llm: LLM) -> None:
    model, fe = hf_parts(whisper_dir)
    feats = fe(list(CLIPS), sampling_rate=RATE, return_tensors="pt").input_features
    with torch.no_grad():
        ref = model.generate(feats, do_sample=False, max_new_tokens=MAX_TOKENS)
    eos = model.config.eos_token_id
    prompts = [{"prompt": "", "multi_modal_data": {"audio": (clip, RATE)}} for clip in CLIPS]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outs = llm.generate(prompts, params, use_tqdm=False)
    got = [strip_eos(list(o.outputs[0].token_ids), eos) for o in outs]
    assert got == [strip_eos(row.tolist(), eos) for row in ref]
    assert len({tuple(g) for g in got}) > 1  # the clips do give different transcriptions
    assert llm.llm_engine.runner.kind_part.num_encoder_runs == len(CLIPS)
    assert_pool_clean(llm.llm_engine)


def test_greedy_equals_hf_under_preemption(whisper_dir: str) -> None:
    """20 blocks of 8: two requests hold 18 (7 cross + 2 decoder blocks each), so growing
    decoders preempt each other; resumed requests rerun their encoder and match HF anyway."""
    model, fe = hf_parts(whisper_dir)
    clips = CLIPS * 2
    feats = fe(list(clips), sampling_rate=RATE, return_tensors="pt").input_features
    with torch.no_grad():
        ref = model.generate(feats, do_sample=False, max_new_tokens=30)
    eos = model.config.eos_token_id
    small = LLM(whisper_dir, dtype="float32", num_gpu_blocks=20, block_size=8, max_model_len=40)
    prompts = [{"prompt": "", "multi_modal_data": {"audio": (clip, RATE)}} for clip in clips]
    outs = small.generate(prompts, SamplingParams(temperature=0.0, max_tokens=30), use_tqdm=False)
    got = [strip_eos(list(o.outputs[0].token_ids), eos) for o in outs]
    assert got == [strip_eos(row.tolist(), eos) for row in ref]
    engine = small.llm_engine
    assert engine.get_stats().num_preemptions_total > 0
    assert engine.runner.kind_part.num_encoder_runs > len(clips)
    assert_pool_clean(engine)


def test_task_prompt_in_both_forms_equals_hf_teacher_forced(whisper_dir: str, llm: LLM) -> None:
    """A multi-token decoder prompt (Whisper's task tokens), given as vLLM's audio dict or as
    encoder/decoder prompts: each generated token is HF's argmax after the tokens before it."""
    model, fe = hf_parts(whisper_dir)
    clip = CLIPS[2]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    audio = {"prompt": "", "multi_modal_data": {"audio": (clip, RATE)}}
    outs = llm.generate(
        [
            {"prompt": TASK_PROMPT, "multi_modal_data": {"audio": (clip, RATE)}},
            {"encoder_prompt": audio, "decoder_prompt": TASK_PROMPT},
        ],
        params,
        use_tqdm=False,
    )
    task_tokens = ["<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|notimestamps|>"]
    prompt_ids = llm.get_tokenizer().convert_tokens_to_ids(task_tokens)
    assert prompt_ids[0] == model.config.decoder_start_token_id
    assert outs[0].prompt_token_ids == outs[1].prompt_token_ids == prompt_ids
    full = outs[0].prompt_token_ids + list(outs[0].outputs[0].token_ids)
    feats = fe(clip, sampling_rate=RATE, return_tensors="pt").input_features
    with torch.no_grad():
        logits = model(input_features=feats, decoder_input_ids=torch.tensor([full[:-1]])).logits
    expected = logits[0, len(outs[0].prompt_token_ids) - 1 :].argmax(-1).tolist()
    assert list(outs[0].outputs[0].token_ids) == expected
    assert list(outs[1].outputs[0].token_ids) == expected


def test_bad_audio_is_refused_with_a_clear_error(llm: LLM) -> None:
    params = SamplingParams(max_tokens=2)

    def run(audio: object) -> None:
        llm.generate({"prompt": "", "multi_modal_data": {"audio": audio}}, params, use_tqdm=False)

    with pytest.raises(ValueError, match=r"1\.50 s long.*window of 1\.00 s"):
        run((sweep(1.5, 100, 200), RATE))
    with pytest.raises(ValueError, match="8000 Hz.*16000 Hz"):
        run((sweep(0.5, 100, 200), 8000))
    with pytest.raises(ValueError, match="1-D array"):
        run((np.zeros((2, 100), dtype=np.float32), RATE))
    with pytest.raises(ValueError, match="pair"):
        run(sweep(0.5, 100, 200))
    with pytest.raises(ValueError, match="speech model"):
        llm.generate("hello", params, use_tqdm=False)
    out = llm.generate({"prompt": "", "multi_modal_data": {"audio": (CLIPS[0], RATE)}}, params)
    assert len(out[0].outputs[0].token_ids) >= 1  # still serving
    assert_pool_clean(llm.llm_engine)
