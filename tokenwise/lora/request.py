"""`LoRARequest`: which adapter a request runs with (vLLM's name and fields)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name (what the server's `model` field says), id and PEFT directory.

    `lora_int_id` is the adapter's identity inside the engine: slots, the host cache and
    prefix-cache keys go by it, so two requests naming the same id must mean the same adapter.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool):
            raise ValueError(f"lora_int_id must be an int, got {self.lora_int_id!r}")
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1, got {self.lora_int_id}")
        if not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")
        if not self.lora_path:
            raise ValueError(f"LoRA adapter {self.lora_name!r} needs a lora_path")
