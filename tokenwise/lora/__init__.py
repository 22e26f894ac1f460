"""Multi-LoRA serving: adapter slots in the linear layers, a PEFT reader, the slot manager."""

from tokenwise.lora.request import LoRARequest

__all__ = ["LoRARequest"]
