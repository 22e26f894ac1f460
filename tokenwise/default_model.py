"""Where the built-in model lives: a small checkpoint shipped inside the package."""

from __future__ import annotations

import os

DEFAULT_MODEL_DIR = os.path.join(os.path.dirname(__file__), "models_data", "default")


def resolve_model_path(model: str | None) -> str:
    """None (or "default") means the built-in model; anything else is a local directory."""
    if model is None or model == "default":
        if not os.path.isfile(os.path.join(DEFAULT_MODEL_DIR, "config.json")):
            raise FileNotFoundError(
                f"the built-in model is missing from {DEFAULT_MODEL_DIR}; reinstall tokenwise or "
                "run tools/train_default_model.py"
            )
        return DEFAULT_MODEL_DIR
    return os.path.expanduser(model)
