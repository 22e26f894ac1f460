"""Audio input of speech models (Whisper): 16 kHz float samples in, log-mel features out.

The features are transformers' `WhisperFeatureExtractor`, loaded from the checkpoint's
`preprocessor_config.json`, so tokenwise feeds the encoder exactly what HF's processor would.
The extractor pads every clip to the model's window (`n_samples`, 30 s for real Whisper); a
longer clip would be cut silently, so it is refused here instead, naming both lengths.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

PREPROCESSOR_CONFIG = "preprocessor_config.json"


def load_feature_extractor(model_dir: str) -> Any:
    """The checkpoint's Whisper feature extractor (offline)."""
    from transformers import WhisperFeatureExtractor

    if not os.path.isfile(os.path.join(model_dir, PREPROCESSOR_CONFIG)):
        raise ValueError(
            f"{model_dir!r} has no {PREPROCESSOR_CONFIG}: an audio model needs its feature "
            "extractor settings next to the weights"
        )
    return WhisperFeatureExtractor.from_pretrained(model_dir, local_files_only=True)


def as_audio_array(audio: Any) -> tuple[np.ndarray, int]:
    """`(samples, sample_rate)` from vLLM's `(array, sample_rate)` pair, checked."""
    if not isinstance(audio, (tuple, list)) or len(audio) != 2:
        raise ValueError(
            "multi_modal_data['audio'] must be a pair (samples, sample_rate), e.g. "
            "(numpy_array, 16000)"
        )
    samples, rate = audio
    if isinstance(rate, bool) or not isinstance(rate, (int, np.integer)) or rate <= 0:
        raise ValueError(f"audio sample_rate must be a positive integer, got {rate!r}")
    array = np.asarray(samples.cpu() if isinstance(samples, torch.Tensor) else samples)
    if array.ndim == 2 and 1 in array.shape:
        array = array.reshape(-1)
    if array.ndim != 1 or array.size == 0 or not np.issubdtype(array.dtype, np.number):
        raise ValueError(
            f"audio samples must be a non-empty 1-D array of numbers (mono), got shape "
            f"{array.shape} of {array.dtype}"
        )
    array = array.astype(np.float32)
    if not np.isfinite(array).all():
        raise ValueError("audio samples must be finite (no NaN or infinity)")
    return array, int(rate)


def audio_to_features(feature_extractor: Any, audio: Any) -> torch.Tensor:
    """Log-mel features `[num_mel_bins, frames]` of one clip, padded to the model's window."""
    array, rate = as_audio_array(audio)
    expected = int(feature_extractor.sampling_rate)
    if rate != expected:
        raise ValueError(
            f"audio sample_rate is {rate} Hz; this model takes {expected} Hz audio (resample it)"
        )
    window = int(feature_extractor.n_samples)
    if array.size > window:
        raise ValueError(
            f"audio is {array.size / rate:.2f} s long ({array.size} samples), longer than the "
            f"model's window of {window / rate:.2f} s ({window} samples); split it"
        )
    features = feature_extractor(array, sampling_rate=rate, return_tensors="pt").input_features
    return features[0]
