"""A toy hybrid model: a tiny Llama whose listed layers mix tokens with a recurrent state.

Until the Gated DeltaNet models land, this is the recurrent-state layer the engine's state
handling is tested with. `ToyRecurrentMixer` keeps, per channel, `h_t = decay * h_(t-1) +
k_t * v_t` and outputs `q_t * h_t`; it walks the tokens one by one, so the state after a token
is the same bits however the tokens were chunked into steps, which is what lets the tests ask
for bit-for-bit equality after a prefix hit, a preemption or a speculative rollback.

`ToyHybridForCausalLM` is a Llama checkpoint with `architectures` renamed and
`toy_recurrent_layers` set in its config: those layers keep their q/k/v and output
projections (so every weight loads) but drop their attention for the mixer.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tokenwise.attention.recurrent import RecurrentMetadata, RecurrentStateLayer
from tokenwise.distributed.tp_state import get_tp_rank
from tokenwise.layer_registry import get_layers_from_config
from tokenwise.models.llama import LlamaForCausalLM
from tokenwise.models.registry import MODEL_REGISTRY

ARCH = "ToyHybridForCausalLM"


class ToyRecurrentMixer(RecurrentStateLayer):
    """`width` channels of the model's `full_width`, starting at `offset` (a TP rank's)."""

    def __init__(self, width: int, prefix: str, config: Any, offset: int, full_width: int) -> None:
        super().__init__(width, prefix, config)
        g = torch.Generator().manual_seed(zlib.crc32(prefix.encode()))
        decay = torch.rand(full_width, generator=g) * 0.5 + 0.4
        self.register_buffer("decay", decay[offset : offset + width].clone())

    def mix(self, x: torch.Tensor, states: torch.Tensor, md: RecurrentMetadata) -> torch.Tensor:
        q, k, v = x.chunk(3, dim=-1)
        out = torch.empty_like(q)
        kept = None
        if any(md.keep_token_states):
            kept = md.token_states.setdefault(
                self.layer_name, torch.zeros(x.shape[0], self.state_numel, dtype=states.dtype)
            )
        for i in range(md.num_reqs):
            slot = md.state_slots[i]
            h = states[slot].clone()
            for t in range(md.query_start_loc[i], md.query_start_loc[i + 1]):
                h = self.decay * h + k[t] * v[t]
                out[t] = q[t] * h
                if kept is not None and md.keep_token_states[i]:
                    kept[t] = h
            states[slot] = h
        return out


class ToyMixerBlock(nn.Module):
    """Stands in for a layer's `self_attn`: its projections around the recurrent mixer.

    Per KV head: its group's first query head, its key and value feed one channel block of the
    state; the output goes to every query head of the group. Under TP a rank holds whole
    groups, so the same function is computed split by heads.
    """

    def __init__(self, attn: nn.Module, prefix: str, config: Any) -> None:
        super().__init__()
        self.qkv_proj, self.o_proj = attn.qkv_proj, attn.o_proj
        self.kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        self.group = attn.num_heads // attn.num_kv_heads
        width = self.kv_heads * self.head_dim
        full = config.model.num_kv_heads * self.head_dim
        self.mixer = ToyRecurrentMixer(width, prefix, config, get_tp_rank() * width, full)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        # One token at a time: a matmul's rows may round differently with the batch's height,
        # and the tests compare states bit for bit across steps of different shapes.
        rows = [self.qkv_proj(hidden_states[t : t + 1]) for t in range(hidden_states.shape[0])]
        qkv = torch.cat(rows) if rows else self.qkv_proj(hidden_states)
        q, k, v = qkv.split(self.qkv_proj.output_sizes, dim=-1)
        n, kv, hd = q.shape[0], self.kv_heads, self.head_dim
        first_q = q.reshape(n, kv, self.group, hd)[:, :, 0].reshape(n, kv * hd)
        out = self.mixer(torch.cat([first_q, k, v], dim=-1))
        per_head = out.reshape(n, kv, 1, hd).expand(n, kv, self.group, hd)
        return self.o_proj(per_head.reshape(n, kv * self.group * hd))


class ToyHybridForCausalLM(LlamaForCausalLM):
    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        registry = config.compilation.static_forward_context
        model = self.model
        for i in config.model.hf_config.toy_recurrent_layers:
            if not model.start_layer <= i < model.end_layer:
                continue  # another pipeline stage's layer
            layer = model.layers[i]
            del registry[layer.self_attn.attn.layer_name]
            prefix = f"model.layers.{i}.self_attn.mixer"
            layer.self_attn = ToyMixerBlock(layer.self_attn, prefix, config)
        assert get_layers_from_config(config, RecurrentStateLayer)


MODEL_REGISTRY[ARCH] = ToyHybridForCausalLM


def toy_hybrid_checkpoint(llama_dir: str, out: Path, recurrent_layers: list[int]) -> str:
    """A copy of a tiny Llama checkpoint as a toy hybrid (symlinked weights)."""
    out.mkdir(parents=True, exist_ok=True)
    for item in Path(llama_dir).iterdir():
        target = out / item.name
        if item.name == "config.json":
            config = json.loads(item.read_text())
            config["architectures"] = [ARCH]
            config["toy_recurrent_layers"] = recurrent_layers
            target.write_text(json.dumps(config))
        elif not target.exists():
            target.symlink_to(item)
    return str(out)
