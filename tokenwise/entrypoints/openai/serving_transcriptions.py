"""`/v1/audio/transcriptions`: OpenAI's speech-to-text endpoint over a Whisper engine.

The request is a multipart form (what the official client sends): `file` (the audio), `model`,
and optionally `language` (default "en"), `prompt`, `response_format` ("json" or "text") and
`temperature` (default 0, greedy). The file is decoded with `soundfile`; WAV and FLAC are
accepted (mono, or channels averaged), at the feature extractor's sample rate (16 kHz for
Whisper): anything else, and audio longer than the model's window, is a 400 naming `file` and
what was wrong, as are a language the tokenizer has no token for and the response formats this
server does not produce (srt, vtt, verbose_json).

The decoder prompt is Whisper's task prefix, as vLLM builds it:
`<|startoftranscript|><|{language}|><|transcribe|><|notimestamps|>{prompt}`, and the audio goes
to the encoder; generation runs until EOS or max_model_len. The response is `{"text": ...}`
with the audio's duration as usage.
"""

from __future__ import annotations

import io
import math
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel

from tokenwise.entrypoints.openai.access_log import set_request_id
from tokenwise.entrypoints.openai.async_engine import AsyncEngine, RequestStream
from tokenwise.entrypoints.openai.errors import OpenAIError, generation_failed, invalid_request
from tokenwise.entrypoints.openai.server_config import ServerConfig
from tokenwise.entrypoints.openai.serving_common import respond
from tokenwise.entrypoints.openai.serving_models import ServingModels
from tokenwise.outputs import RequestOutput
from tokenwise.sampling.params import SamplingParams

SAMPLE_RATE = 16000
ACCEPTED_FORMATS = ("WAV", "FLAC")
RESPONSE_FORMATS = ("json", "text")
TASK_PREFIX = "<|startoftranscript|><|{language}|><|transcribe|><|notimestamps|>"


class TranscriptionUsage(BaseModel):
    type: str = "duration"
    seconds: int


class TranscriptionResponse(BaseModel):
    text: str
    usage: TranscriptionUsage


def decode_audio(data: bytes, filename: str) -> np.ndarray:
    """Mono float32 samples of a WAV or FLAC file; a 400 naming `file` for anything else."""
    import soundfile

    what = f"file {filename!r}" if filename else "the uploaded file"
    try:
        info = soundfile.info(io.BytesIO(data))
    except (RuntimeError, soundfile.LibsndfileError, TypeError) as exc:
        ext = filename.rsplit(".", 1)[-1].lower() if "." in filename else "unknown"
        raise OpenAIError(
            400,
            f"could not decode {what} (format {ext!r}): send WAV or FLAC audio ({exc})",
            param="file",
        ) from None
    if info.format not in ACCEPTED_FORMATS:
        raise OpenAIError(
            400,
            f"{what} is {info.format} audio; this server accepts WAV or FLAC",
            param="file",
        )
    if info.samplerate != SAMPLE_RATE:
        raise OpenAIError(
            400,
            f"{what} has a sample rate of {info.samplerate} Hz; send {SAMPLE_RATE} Hz audio",
            param="file",
        )
    samples, _ = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    if samples.shape[0] == 0:
        raise OpenAIError(400, f"{what} holds no audio samples", param="file")
    return samples.mean(axis=1)


def form_value(form: Any, name: str, default: str | None = None) -> str | None:
    value = form.get(name, default)
    if value is not None and not isinstance(value, str):
        raise OpenAIError(400, f"{name} must be a form field, not a file", param=name)
    return value


class TranscriptionServing:
    def __init__(self, engine: AsyncEngine, config: ServerConfig, models: ServingModels) -> None:
        self.engine = engine
        self.config = config
        self.models = models

    def _check_model(self, model: str | None) -> None:
        if not self.config.supports_audio:
            raise OpenAIError(
                400,
                f"the model {self.config.served_model_name!r} takes no audio; serve a speech "
                "model (Whisper) for /v1/audio/transcriptions",
                param="model",
                code="model_not_supported",
            )
        if self.models.resolve(model) is not None:
            raise OpenAIError(400, "LoRA adapters are not served for audio", param="model")

    def _decoder_prompt(self, language: str, prompt: str | None) -> str:
        token = f"<|{language}|>"
        tokenizer = getattr(self.engine.engine, "tokenizer", None)
        vocab = tokenizer.get_vocab() if tokenizer is not None else {}
        if token not in vocab:
            raise OpenAIError(
                400, f"language {language!r} is not known to this model's tokenizer", "language"
            )
        return TASK_PREFIX.format(language=language) + (prompt or "")

    async def create(self, raw: Request) -> Response:
        try:
            form = await raw.form()
        except Exception as exc:  # not a multipart body, or a malformed one
            raise OpenAIError(400, f"expected a multipart/form-data body ({exc})") from None
        self._check_model(form_value(form, "model"))
        upload = form.get("file")
        if upload is None or isinstance(upload, str):
            raise OpenAIError(400, "file is required: the audio to transcribe", param="file")
        response_format = form_value(form, "response_format", "json") or "json"
        if response_format not in RESPONSE_FORMATS:
            raise OpenAIError(
                400,
                f"response_format {response_format!r} is not supported; use json or text",
                param="response_format",
            )
        language = form_value(form, "language") or "en"
        decoder_prompt = self._decoder_prompt(language, form_value(form, "prompt"))
        try:
            temperature = float(form_value(form, "temperature", "0") or 0)
            params = SamplingParams(temperature=temperature, max_tokens=None)
        except ValueError as exc:
            raise OpenAIError(400, f"temperature: {exc}", param="temperature") from None
        samples = decode_audio(await upload.read(), upload.filename or "")
        audio = (samples, SAMPLE_RATE)
        prompt = {"prompt": decoder_prompt, "multi_modal_data": {"audio": audio}}
        request_id = set_request_id(raw, "trsc")
        try:
            stream = await self.engine.submit(request_id, [prompt], params)
        except (ValueError, TypeError) as exc:
            raise invalid_request(exc, "file") from exc
        seconds = math.ceil(samples.size / SAMPLE_RATE)
        response = await respond(raw, stream, self._collect(stream, seconds))
        if response_format == "text" and response.status_code == 200:
            body = TranscriptionResponse.model_validate_json(response.body)
            return PlainTextResponse(body.text)
        return response

    async def _collect(self, stream: RequestStream, seconds: int) -> TranscriptionResponse:
        merged: RequestOutput | None = None
        async for _, delta in stream:
            if merged is None:
                merged = delta
            else:
                merged.merge(delta)
        if merged is None or merged.error is not None or not merged.outputs:
            raise generation_failed(merged.error if merged else "the request was aborted")
        text = merged.outputs[0].text
        return TranscriptionResponse(text=text, usage=TranscriptionUsage(seconds=seconds))
