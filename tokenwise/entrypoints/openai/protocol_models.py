"""Bodies of `/v1/models` and of vLLM's LoRA adapter endpoints, as pydantic models.

Apart from `protocol.py` because they describe what the server serves (the base model and its
loaded adapters), not a request to run: `serving_models` builds the cards and `api_server`
takes the load/unload requests.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from tokenwise.entrypoints.openai.protocol import created_now
from tokenwise.entrypoints.openai.request_fields import RequestModel


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=created_now)
    owned_by: str = "tokenwise"
    max_model_len: int
    root: str | None = None  # a LoRA adapter's directory
    parent: str | None = None  # a LoRA adapter's base model
    # What a prompt may hold: ["text"], or ["text", "image"] for a vision-language model.
    input_modalities: list[str] = Field(default_factory=lambda: ["text"])


class LoadLoRAAdapterRequest(RequestModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(RequestModel):
    lora_name: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
