"""`/v1/audio/transcriptions` through the official `openai` client against `tokenwise serve`
with a tiny Whisper checkpoint.

Audio is made here (a chirp with noise) and written with soundfile as WAV and as FLAC; the
expected text is `LLM.generate` on the same samples (as soundfile reads them back) with the
decoder prompt the endpoint documents. `LLM.generate` itself is checked against HF in
tests/models/test_whisper_vs_hf.py.
"""

from __future__ import annotations

import io

import numpy as np
import openai
import pytest
import soundfile
from openai import OpenAI

from tests.entrypoints._server import RemoteServer, openai_client, wait_for_idle
from tests.tiny_checkpoints import build_tiny_checkpoint
from tokenwise.entrypoints.llm import LLM
from tokenwise.sampling.params import SamplingParams

NAME = "tiny-whisper"
RATE = 16000
TASK_PROMPT = "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>"


def chirp(seconds: float, seed: int = 0) -> np.ndarray:
    t = np.arange(int(seconds * RATE)) / RATE
    noise = np.random.default_rng(seed).normal(0, 0.05, t.shape)
    return (0.5 * np.sin(2 * np.pi * (300 + 2000 * t) * t) + noise).astype(np.float32)


def encoded(samples: np.ndarray, fmt: str, rate: int = RATE) -> bytes:
    buf = io.BytesIO()
    soundfile.write(buf, samples, rate, format=fmt)
    return buf.getvalue()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("asr"), "WhisperForConditionalGeneration")


@pytest.fixture(scope="module", autouse=True)
def booting_server(model_dir: str):
    with RemoteServer(model_dir, "--served-model-name", NAME, wait=False) as srv:
        yield srv


@pytest.fixture(scope="module")
def server(booting_server: RemoteServer) -> RemoteServer:
    return booting_server.wait_healthy()


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> OpenAI:
    return openai_client(server)


@pytest.fixture(scope="module")
def llm(model_dir: str) -> LLM:
    return LLM(model_dir, dtype="float32", device="cpu", num_gpu_blocks=64)


def expected_text(llm: LLM, data: bytes) -> str:
    samples, rate = soundfile.read(io.BytesIO(data), dtype="float32")
    prompt = {"prompt": TASK_PROMPT, "multi_modal_data": {"audio": (samples, rate)}}
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=None), use_tqdm=False)
    return out[0].outputs[0].text


@pytest.mark.parametrize("fmt", ["WAV", "FLAC"])
def test_transcription_equals_llm_generate(llm: LLM, client: OpenAI, fmt: str) -> None:
    data = encoded(chirp(0.7, seed=3), fmt)
    result = client.audio.transcriptions.create(
        model=NAME, file=(f"clip.{fmt.lower()}", data), language="en"
    )
    expected = expected_text(llm, data)
    assert expected  # the tiny model says something for this clip
    assert result.text == expected
    text = client.audio.transcriptions.create(
        model=NAME, file=(f"clip.{fmt.lower()}", data), response_format="text"
    )
    assert text == expected


def test_bad_uploads_are_400s_naming_the_problem(client: OpenAI, server: RemoteServer) -> None:
    with pytest.raises(openai.BadRequestError, match="'mp3'.*WAV or FLAC") as err:
        client.audio.transcriptions.create(model=NAME, file=("song.mp3", b"ID3\x03garbage" * 50))
    assert err.value.body["param"] == "file"
    too_long = encoded(chirp(1.5), "WAV")
    with pytest.raises(openai.BadRequestError, match=r"1\.50 s long.*window of 1\.00 s"):
        client.audio.transcriptions.create(model=NAME, file=("long.wav", too_long))
    with pytest.raises(openai.BadRequestError, match="OGG audio"):
        client.audio.transcriptions.create(model=NAME, file=("a.ogg", encoded(chirp(0.2), "OGG")))
    with pytest.raises(openai.BadRequestError, match="8000 Hz"):
        data = encoded(chirp(0.2), "WAV", rate=8000)
        client.audio.transcriptions.create(model=NAME, file=("slow.wav", data))
    with pytest.raises(openai.BadRequestError, match="language 'xx'"):
        data = encoded(chirp(0.2), "WAV")
        client.audio.transcriptions.create(model=NAME, file=("a.wav", data), language="xx")
    with pytest.raises(openai.BadRequestError, match="response_format 'srt'"):
        client.audio.transcriptions.create(model=NAME, file=("a.wav", data), response_format="srt")
    with pytest.raises(openai.NotFoundError, match="the model 'other' does not exist"):
        client.audio.transcriptions.create(model="other", file=("a.wav", data))
    assert client.audio.transcriptions.create(model=NAME, file=("a.wav", data)).text is not None
    wait_for_idle(server)  # nothing left running, every block of both caches free
