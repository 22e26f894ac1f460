"""Read a checkpoint's sentence-transformers pooling: `modules.json`, `1_Pooling/config.json`.

A sentence-transformers checkpoint lists its pipeline in `modules.json` (Transformer, then
Pooling, often Normalize); the Pooling module's `config.json` says which token states are
combined (`pooling_mode_cls_token`, `pooling_mode_mean_tokens`, `pooling_mode_lasttoken`, ...).
Serving such a checkpoint with another pooling gives vectors that look fine and compare badly,
so what these files say is followed, and a mode tokenwise cannot reproduce is an error.
"""

from __future__ import annotations

import json
import os
from typing import Any

from tokenwise.config import PoolerConfig

MODULES_FILE = "modules.json"
_POOLING_MODULE = "sentence_transformers.models.Pooling"
_NORMALIZE_MODULE = "sentence_transformers.models.Normalize"
_SUPPORTED_MODES = {
    "pooling_mode_cls_token": "CLS",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_lasttoken": "LAST",
}
_UNSUPPORTED_MODES = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)


def _read_json(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read sentence-transformers file {path!r}: {exc}") from exc


def _pooling_type(config_path: str) -> str | None:
    config = _read_json(config_path)
    chosen = [name for key, name in _SUPPORTED_MODES.items() if config.get(key)]
    unsupported = [key for key in _UNSUPPORTED_MODES if config.get(key)]
    if unsupported or len(chosen) > 1:
        modes = [k for k in (*_SUPPORTED_MODES, *_UNSUPPORTED_MODES) if config.get(k)]
        raise ValueError(
            f"{config_path} asks for pooling {modes}; tokenwise pools with exactly one of "
            f"{', '.join(_SUPPORTED_MODES)} (override with override_pooler_config)"
        )
    return chosen[0] if chosen else None


def load_sentence_transformers_pooler(model_dir: str) -> PoolerConfig | None:
    """The pooling the checkpoint's sentence-transformers files declare; None without them.

    Fields the files leave open stay None. A listed Normalize module means normalize=True; a
    pipeline that lists modules but no Normalize means False (its embeddings are not unit
    length, and clients comparing them expect what sentence-transformers would return).
    """
    modules_path = os.path.join(model_dir, MODULES_FILE)
    if not os.path.isfile(modules_path):
        return None
    modules = _read_json(modules_path)
    if not isinstance(modules, list):
        raise ValueError(f"{modules_path} must hold a list of modules")
    pooling_type = None
    for module in modules:
        if isinstance(module, dict) and module.get("type") == _POOLING_MODULE:
            config_path = os.path.join(model_dir, module.get("path", ""), "config.json")
            if os.path.isfile(config_path):
                pooling_type = _pooling_type(config_path)
    normalize = any(isinstance(m, dict) and m.get("type") == _NORMALIZE_MODULE for m in modules)
    return PoolerConfig(pooling_type=pooling_type, normalize=normalize)
