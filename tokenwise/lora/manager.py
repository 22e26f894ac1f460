"""Which adapter sits in which slot, and each step's token-to-slot mask.

The manager attaches a `LoRASlots` to every linear layer of the model once, at start-up, and
maps PEFT's module names (HF names: `...self_attn.q_proj`) onto them (our fused
`...self_attn.qkv_proj`, part 0), using the model's own `stacked_params_mapping`, the same table
its weight loading uses. Adapters are parsed and checked against that map when a request first
names them (`check`), so a bad adapter fails its request at submission. Each step,
`prepare_step` puts the step's adapters into slots (a free one, else the least recently used
one that this step does not need) and writes the mask. The scheduler never mixes more than
`max_loras` adapters in one step, so a step always fits.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import nn

from tokenwise.config import LoRAConfig
from tokenwise.layers.linear import MergedColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from tokenwise.lora.layers import LoRASlots, LoRAState
from tokenwise.lora.peft import PeftAdapter, load_peft_adapter
from tokenwise.lora.request import LoRARequest

logger = logging.getLogger(__name__)
_QKV_PARTS = {"q": 0, "k": 1, "v": 2}


def _hf_targets(model: nn.Module) -> dict[str, tuple[str, int]]:
    """HF module name -> (our linear module's name, part of it), for every linear layer."""
    mapping = getattr(model, "stacked_params_mapping", ())
    targets: dict[str, tuple[str, int]] = {}
    for name, module in model.named_modules():
        if not isinstance(module, ReplicatedLinear):
            continue
        parent, _, leaf = name.rpartition(".")
        fused = [(w, s) for p, w, s in mapping if p == leaf]
        if not fused:
            targets[name] = (name, 0)
            continue
        for hf_leaf, shard in fused:
            part = _QKV_PARTS[shard] if isinstance(shard, str) else int(shard)
            targets[f"{parent}.{hf_leaf}" if parent else hf_leaf] = (name, part)
    return targets


class LoRAManager:
    def __init__(
        self,
        model: nn.Module,
        config: LoRAConfig,
        max_num_tokens: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.state = LoRAState(max_num_tokens, config.max_loras, dtype, device)
        self.targets = _hf_targets(model)
        self.layers: dict[str, ReplicatedLinear] = {}
        for name, module in model.named_modules():
            if isinstance(module, ReplicatedLinear):
                sizes = list(getattr(module, "output_sizes", [module.output_size]))
                module.lora = LoRASlots(
                    self.state, module.input_size, sizes, config.max_lora_rank, dtype, device
                )
                self.layers[name] = module
        # The server checks adapters from its request threads while the engine thread steps.
        self._lock = threading.RLock()
        self._adapters: OrderedDict[int, PeftAdapter] = OrderedDict()  # host cache, LRU first
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, LRU first
        self.num_slot_loads = 0

    # ---- adapters -------------------------------------------------------------------------

    def check(self, request: LoRARequest) -> PeftAdapter:
        """Parse (or find cached) and validate the adapter; raises ValueError naming the problem."""
        with self._lock:
            return self._check(request)

    def _check(self, request: LoRARequest) -> PeftAdapter:
        cached = self._adapters.get(request.lora_int_id)
        if cached is not None:
            if cached.path != request.lora_path:
                raise ValueError(
                    f"lora_int_id {request.lora_int_id} is already {cached.path!r}, not "
                    f"{request.lora_path!r}; give each adapter its own id"
                )
            self._adapters.move_to_end(request.lora_int_id)
            return cached
        adapter = load_peft_adapter(request.lora_path, self.config.max_lora_rank)
        for module, (a, b) in adapter.weights.items():
            self._check_shapes(request, module, a, b)
        self._adapters[request.lora_int_id] = adapter
        limit = self.config.max_cpu_loras or self.config.max_loras
        while len(self._adapters) > limit:  # drop the least recently used that has no slot
            evictable = [i for i in self._adapters if i not in self._slot_of]
            if not evictable:
                break
            del self._adapters[evictable[0]]
        return adapter

    def _check_shapes(self, request: LoRARequest, module: str, a: torch.Tensor, b: torch.Tensor):
        if module not in self.targets:
            raise ValueError(
                f"LoRA adapter {request.lora_name!r} targets {module!r}, which this model does "
                "not have as a linear layer (LoRA on embeddings, the LM head or MoE experts is "
                "not supported)"
            )
        layer = self.layers[self.targets[module][0]]
        part = self.targets[module][1]
        full_in = getattr(layer, "full_input_size", layer.input_size)
        full_out = getattr(layer, "full_output_sizes", [layer.output_size])[part]
        if a.shape[1] != full_in or b.shape[0] != full_out:
            raise ValueError(
                f"LoRA adapter {request.lora_name!r}: {module!r} has A {tuple(a.shape)} and B "
                f"{tuple(b.shape)}, but the layer is {full_in} -> {full_out}"
            )

    # ---- slots ------------------------------------------------------------------------------

    def _load_into_slot(self, slot: int, request: LoRARequest) -> None:
        adapter = self.check(request)
        for layer in self.layers.values():
            layer.lora.clear_slot(slot)  # type: ignore[union-attr]
        for module, (a, b) in adapter.weights.items():
            name, part = self.targets[module]
            layer = self.layers[name]
            a = a.to(self.dtype)
            b = (b.float() * adapter.scaling).to(self.dtype)
            offset = 0
            if isinstance(layer, RowParallelLinear) and layer.tp_size > 1:
                a = a.narrow(1, layer.tp_rank * layer.input_size, layer.input_size)
            elif isinstance(layer, MergedColumnParallelLinear):
                offset = layer.shard_rows(part)[0]
                source, size = layer.source_rows(part)
                b = b.narrow(0, source, size)
            layer.lora.set_part(slot, part, a, b, offset)  # type: ignore[union-attr]
        self.num_slot_loads += 1
        logger.info(
            "LoRA adapter %r (id %d) loaded into slot %d",
            request.lora_name,
            request.lora_int_id,
            slot,
        )

    def _slot_for(self, request: LoRARequest, needed: set[int]) -> int:
        slot = self._slot_of.get(request.lora_int_id)
        if slot is None:
            used = set(self._slot_of.values())
            free = [s for s in range(self.config.max_loras) if s not in used]
            if free:
                slot = free[0]
            else:
                victim = next(i for i in self._slot_of if i not in needed)
                slot = self._slot_of.pop(victim)
            self._load_into_slot(slot, request)
            self._slot_of[request.lora_int_id] = slot
        self._slot_of.move_to_end(request.lora_int_id)
        return slot

    def prepare_step(
        self, lora_requests: Sequence[LoRARequest | None], num_tokens: Sequence[int]
    ) -> bool:
        """Slot every adapter of the step and write the token mask; True when any token uses one.

        `lora_requests[i]` is sequence i's adapter (None: base model), `num_tokens[i]` its
        token count this step, in the step's token order.
        """
        with self._lock:
            return self._prepare_step(lora_requests, num_tokens)

    def _prepare_step(
        self, lora_requests: Sequence[LoRARequest | None], num_tokens: Sequence[int]
    ) -> bool:
        needed = {r.lora_int_id for r in lora_requests if r is not None}
        if len(needed) > self.config.max_loras:
            raise RuntimeError(
                f"a step mixes {len(needed)} adapters but max_loras={self.config.max_loras}"
            )
        slots = [-1 if r is None else self._slot_for(r, needed) for r in lora_requests]
        per_token = torch.repeat_interleave(
            torch.tensor(slots, dtype=torch.int64), torch.tensor(list(num_tokens))
        )
        self.state.set_token_slots(per_token)
        return bool(needed)
