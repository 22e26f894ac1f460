"""The models a server answers to: the base model and its LoRA adapters, by name.

A request's `model` field picks one: the served model name runs the base model, an adapter's
name runs that adapter (vLLM's convention), anything else is a 404 in OpenAI's shape. Adapters
come from `--lora-modules name=path` at start-up and, with `--allow-runtime-lora-updating`,
from `/v1/load_lora_adapter`; each gets the next integer id, which is what the engine keys slots
and cached blocks by, so a name reloaded with another path never reuses the old one's blocks.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

from tokenwise.entrypoints.openai.errors import OpenAIError
from tokenwise.entrypoints.openai.protocol_models import ModelCard
from tokenwise.lora.peft import load_peft_adapter
from tokenwise.lora.request import LoRARequest


class ServingModels:
    def __init__(
        self,
        base_model_name: str,
        max_model_len: int,
        lora_modules: dict[str, str] | None = None,
        max_lora_rank: int | None = None,
        validate: Callable[[LoRARequest], None] | None = None,
        input_modalities: list[str] | None = None,
    ) -> None:
        """`validate` (the engine's `check_lora`) checks an adapter against the model, so a
        target module the model lacks is refused when the adapter is loaded, not when used."""
        self.base_model_name = base_model_name
        self.max_model_len = max_model_len
        self.input_modalities = input_modalities or ["text"]
        self.max_lora_rank = max_lora_rank  # None: the engine serves no adapters
        self.validate = validate
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.adapters: dict[str, LoRARequest] = {}
        for name, path in (lora_modules or {}).items():
            try:
                self.load(name, path)
            except OpenAIError as exc:  # at start-up: a plain error for the command line
                raise ValueError(f"--lora-modules {name}={path}: {exc.message}") from None

    def resolve(self, requested: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); 404 when unknown."""
        if requested is None or requested == self.base_model_name:
            return None
        adapter = self.adapters.get(requested)
        if adapter is None:
            names = [self.base_model_name, *self.adapters]
            raise OpenAIError(
                404,
                f"the model {requested!r} does not exist; this server serves {names}",
                param="model",
                code="model_not_found",
            )
        return adapter

    def cards(self) -> list[ModelCard]:
        modalities = self.input_modalities
        base = ModelCard(
            id=self.base_model_name, max_model_len=self.max_model_len, input_modalities=modalities
        )
        return [base] + [
            ModelCard(
                id=name,
                max_model_len=self.max_model_len,
                input_modalities=modalities,
                root=adapter.lora_path,
                parent=self.base_model_name,
            )
            for name, adapter in self.adapters.items()
        ]

    def load(self, name: str, path: str) -> LoRARequest:
        """Register an adapter after checking its files (rank, format); 400 when they are bad."""
        if self.max_lora_rank is None:
            raise OpenAIError(400, "this server was started without --enable-lora", param="lora")
        if not name or name == self.base_model_name:
            raise OpenAIError(400, f"invalid adapter name {name!r}", param="lora_name")
        with self._lock:
            if name in self.adapters:
                raise OpenAIError(400, f"adapter {name!r} is already loaded", param="lora_name")
            adapter = LoRARequest(name, next(self._ids), path)
            try:
                load_peft_adapter(path, self.max_lora_rank)
                if self.validate is not None:
                    self.validate(adapter)
            except (ValueError, OSError) as exc:
                raise OpenAIError(400, str(exc), param="lora_path") from exc
            self.adapters[name] = adapter
        return adapter

    def unload(self, name: str) -> None:
        with self._lock:
            if self.adapters.pop(name, None) is None:
                raise OpenAIError(
                    404,
                    f"no adapter named {name!r} is loaded",
                    param="lora_name",
                    code="model_not_found",
                )
