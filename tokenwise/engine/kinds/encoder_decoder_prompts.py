"""Prompts of encoder-decoder models, in vLLM's forms, validated before anything is queued.

- `{"encoder_prompt": E, "decoder_prompt": D}`: E is a string, token ids, `{"prompt": ...}` /
  `{"prompt_token_ids": [...]}`, or for an audio model `{"prompt": "", "multi_modal_data":
  {"audio": (samples, sample_rate)}}`; D is a string, token ids or such a dict, or None.
- `{"prompt": D, "multi_modal_data": {"audio": (samples, sample_rate)}}` (audio models): the
  audio goes to the encoder and the text is the decoder prompt, as vLLM does for Whisper.
- Anything else a decoder-only model accepts (a string, token ids, `{"prompt": ...}`) is the
  encoder prompt of a text model, with the default decoder prompt.

The decoder prompt starts with the model's `decoder_start_token_id`, which is prepended when
absent; no decoder prompt means just that token. This is what HF `generate` feeds the decoder.
A decoder prompt given as text is tokenized without special tokens (the start token is the
model's, not the tokenizer's BOS).
"""

from __future__ import annotations

from typing import Any

from tokenwise.engine.kinds.audio import audio_to_features, load_feature_extractor
from tokenwise.engine.kinds.encoder_inputs import EncoderInputs
from tokenwise.engine.prompts import PromptInput, check_text, to_token_ids
from tokenwise.model_config import ModelConfig
from tokenwise.models.registry import resolve_model_class


class EncoderDecoderPrompts:
    """Turns one request's prompt into (decoder text, decoder token ids, encoder inputs)."""

    def __init__(self, model_config: ModelConfig, tokenizer: Any) -> None:
        hf = model_config.hf_config
        model_cls = resolve_model_class(model_config.architectures)
        self.tokenizer = tokenizer
        self.vocab_size = model_config.vocab_size
        self.max_model_len = model_config.max_model_len
        self.decoder_start_token_id = int(hf.decoder_start_token_id)
        self.max_encoder_len = int(model_cls.max_encoder_len(hf))
        self.is_audio = getattr(model_cls, "encoder_input_kind", "tokens") == "audio"
        self.feature_extractor = (
            load_feature_extractor(model_config.model) if self.is_audio else None
        )

    def process(self, prompt: PromptInput) -> tuple[str | None, list[int], EncoderInputs]:
        if isinstance(prompt, dict) and ("encoder_prompt" in prompt or "decoder_prompt" in prompt):
            extra = set(prompt) - {"encoder_prompt", "decoder_prompt"}
            if extra or "encoder_prompt" not in prompt:
                raise ValueError(
                    "an encoder-decoder prompt is {'encoder_prompt': ..., 'decoder_prompt': ...}"
                    f" (decoder_prompt optional); got keys {sorted(prompt)}"
                )
            encoder = self._encoder(prompt["encoder_prompt"])
            text, ids = self._decoder(prompt.get("decoder_prompt"))
            return text, ids, encoder
        if isinstance(prompt, dict) and "multi_modal_data" in prompt:
            encoder = self._encoder(prompt)
            decoder = {k: v for k, v in prompt.items() if k != "multi_modal_data"} or None
            text, ids = self._decoder(decoder)
            return text, ids, encoder
        if self.is_audio:
            raise ValueError(
                "this is a speech model: give audio as {'prompt': <decoder text>, "
                "'multi_modal_data': {'audio': (samples, sample_rate)}}"
            )
        return (*self._decoder(None), self._encoder(prompt))

    def _encoder(self, prompt: Any) -> EncoderInputs:
        audio = None
        if isinstance(prompt, dict) and "multi_modal_data" in prompt:
            data = prompt["multi_modal_data"]
            if not isinstance(data, dict) or set(data) != {"audio"}:
                raise ValueError("multi_modal_data must be {'audio': (samples, sample_rate)}")
            audio = data["audio"]
        if self.is_audio:
            if audio is None:
                raise ValueError("the encoder prompt of a speech model must carry audio")
            features = audio_to_features(self.feature_extractor, audio)
            return EncoderInputs(self.max_encoder_len, input_features=features)
        if audio is not None:
            raise ValueError("this model has a text encoder; it takes no audio")
        text, ids = to_token_ids(prompt, self.tokenizer, self.vocab_size)
        if len(ids) > self.max_encoder_len:
            raise ValueError(
                f"encoder prompt has {len(ids)} tokens, more than the encoder's "
                f"{self.max_encoder_len} positions"
            )
        return EncoderInputs(len(ids), token_ids=ids, prompt=text)

    def _decoder(self, prompt: Any) -> tuple[str | None, list[int]]:
        start = self.decoder_start_token_id
        if prompt is None or prompt == {}:
            return None, [start]
        if isinstance(prompt, dict) and "prompt_token_ids" not in prompt:
            prompt = prompt.get("prompt")
            if prompt is None:
                raise ValueError("a decoder prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text decoder prompts need a tokenizer; pass token ids")
            check_text(prompt, "decoder_prompt")
            text, ids = prompt, self.tokenizer.encode(prompt, add_special_tokens=False)
            ids = to_token_ids(list(ids), None, self.vocab_size)[1] if ids else []
        else:
            text, ids = to_token_ids(prompt, self.tokenizer, self.vocab_size)
        if not ids or ids[0] != start:
            ids = [start, *ids]
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"decoder prompt has {len(ids)} tokens, but max_model_len is "
                f"{self.max_model_len} (the prompt plus one generated token must fit)"
            )
        return text, ids
