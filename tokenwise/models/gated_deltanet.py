"""The Gated DeltaNet token mixer of Qwen3.5 and Qwen3-Next, with its state in the engine's slots.

Per token: one input projection gives q, k, v (the conv channels), z (the output gate), b and a;
q, k and v go through a depthwise causal conv1d (kernel `linear_conv_kernel_dim`) and SiLU;
q and k are L2-normalised (q then scaled by `dk ** -0.5`); `g = -exp(A_log) softplus(a +
dt_bias)` and `beta = sigmoid(b)` drive the gated delta rule (`gated_delta_rule`); the output
goes through an RMSNorm per value head gated by `silu(z)`, then `out_proj`.

A request's state is one flat row of its slot (`RecurrentStateLayer`): first the conv state,
the last `K - 1` conv inputs `[K - 1, channels]` (time-major, so a step's window is the state
followed by its tokens), then the delta-rule state `[v heads, dk, dv]`. Steps of one token
(decode) are batched: the conv over all of them at once and the delta rule in the C kernel
(`native.gdn_decode`) or its torch form; a longer run of a request's tokens (a prefill chunk,
which continues from its slot's state, conv state included) takes the chunked form; a request
verifying drafts (`keep_token_states`) takes the per-token form and leaves the whole row after
each token in `token_states`.

Tensor parallelism shards heads: a rank holds `nk / tp` key heads and `nv / tp` value heads,
and the conv channels of exactly those heads (its q, k and v slices), so everything up to
`out_proj` (row-parallel, all-reduced) is local. The checkpoint spells the projection two ways:
Qwen3.5 `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`; Qwen3-Next `in_proj_qkvz` and
`in_proj_ba`, grouped per key head. `GatedDeltaNetInProj` loads either into one fused weight.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenwise.attention.recurrent import RecurrentMetadata, RecurrentStateLayer
from tokenwise.config import EngineConfig
from tokenwise.distributed.tp_state import get_tp_rank, get_tp_size
from tokenwise.layers import MergedColumnParallelLinear, RowParallelLinear
from tokenwise.layers.linear import divide
from tokenwise.layers.weight_utils import CheckpointTensor, check_full_shape, materialize
from tokenwise.models.gated_delta_rule import (
    causal_conv,
    chunked_gated_delta_rule,
    delta_rule_step,
    l2_normalize,
    recurrent_gated_delta_rule,
)
from tokenwise.native.gdn_decode import (
    gated_delta_decode,
    gated_delta_decode_step,
    index_tensor,
)


def _rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """`x[rows]`: a view where the rows are consecutive (a batch of decode steps usually is),
    so a one-stream step runs no gather (each a parallel region of its own on CPU)."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return x.narrow(0, rows[0], len(rows))
    return x.index_select(0, torch.tensor(rows, device=x.device))


def _put_rows(x: torch.Tensor, rows: list[int], values: torch.Tensor) -> None:
    """`x[rows] = values`, in place (a copy into a view where the rows are consecutive)."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        x.narrow(0, rows[0], len(rows)).copy_(values)
    else:
        x.index_copy_(0, torch.tensor(rows, device=x.device), values.to(x.dtype))


class GatedDeltaNetInProj(MergedColumnParallelLinear):
    """Parts q, k, v, z, b, a (full sizes `[kd, kd, vd, vd, nv, nv]`), each sliced by heads.

    Shard ids: "qkv", "z", "b", "a" (Qwen3.5's tensors) or "qkvz", "ba" (Qwen3-Next's, whose
    rows are grouped by key head: per head q, k, then its value heads' v and z, resp. b and a).
    """

    def __init__(self, hidden: int, nk: int, nv: int, dk: int, dv: int) -> None:
        self.nk, self.nv, self.dk, self.dv = nk, nv, dk, dv
        sizes = [nk * dk, nk * dk, nv * dv, nv * dv, nv, nv]
        super().__init__(hidden, sizes, False, what="linear attention heads' width")

    def _load_parts(
        self, param: nn.Parameter, loaded: CheckpointTensor, first: int, sizes: list[int]
    ) -> None:
        check_full_shape(loaded, (sum(sizes), param.shape[1]))
        start = 0
        for index, size in enumerate(sizes, start=first):
            super().weight_loader(param, loaded.narrow(0, start, size), index)
            start += size

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: CheckpointTensor, shard_id: object = None
    ) -> None:
        full = self.full_output_sizes
        single = {"z": 3, "b": 4, "a": 5}
        if shard_id == "qkv":
            self._load_parts(param, loaded_weight, 0, full[:3])
        elif shard_id in single:
            super().weight_loader(param, loaded_weight, single[shard_id])  # type: ignore[index]
        elif shard_id in ("qkvz", "ba"):
            ratio, hidden = self.nv // self.nk, param.shape[1]
            group = [self.dk, self.dk, ratio * self.dv, ratio * self.dv]
            if shard_id == "ba":
                group = [ratio, ratio]
            check_full_shape(loaded_weight, (self.nk * sum(group), hidden))
            grouped = materialize(loaded_weight).reshape(self.nk, sum(group), hidden)
            parts = [p.reshape(-1, hidden) for p in grouped.split(group, dim=1)]
            self._load_parts(
                param,
                torch.cat(parts),
                0 if shard_id == "qkvz" else 4,
                full[:4] if shard_id == "qkvz" else full[4:],
            )
        else:
            raise ValueError(
                f"Gated DeltaNet in_proj shard must be one of qkv, z, b, a, qkvz, ba; got "
                f"{shard_id!r}"
            )


def _head_slices_loader(sizes: list[int], dim: int = 0) -> Any:
    """A loader copying this rank's slice of each consecutive part (`sizes`, full) of a
    checkpoint tensor along `dim`: the conv weight's q/k/v channels, A_log's heads."""
    rank, tp = get_tp_rank(), get_tp_size()

    def load(param: nn.Parameter, loaded: CheckpointTensor, shard_id: object = None) -> None:
        if shard_id is not None:
            raise ValueError(f"this parameter is not fused; got shard id {shard_id!r}")
        tensor = materialize(loaded)
        if tensor.shape[dim] != sum(sizes):
            raise ValueError(
                f"checkpoint tensor has {tensor.shape[dim]} rows, expected {sum(sizes)}"
            )
        pieces = [
            part.narrow(dim, rank * (part.shape[dim] // tp), part.shape[dim] // tp)
            for part in tensor.split(sizes, dim=dim)
        ]
        local = torch.cat(pieces, dim=dim).reshape(param.shape)
        param.data.copy_(local)

    return load


class ConvWeight(nn.Module):
    """The depthwise conv1d's weight `[channels, 1, K]`, under the checkpoint's name."""

    def __init__(self, channels: int, taps: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, taps), requires_grad=False)


class GatedRMSNorm(nn.Module):
    """RMSNorm over each value head (weight `[dv]`, plain scale), times `silu(z)`."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (self.weight * x32.to(x.dtype) * F.silu(z.float())).to(x.dtype)


class GatedDeltaNet(RecurrentStateLayer):
    """The `linear_attn` module of a linear-attention layer (checkpoint names kept)."""

    def __init__(self, config: EngineConfig, prefix: str) -> None:
        hf = config.model.hf_config
        tp = get_tp_size()
        nk, nv = int(hf.linear_num_key_heads), int(hf.linear_num_value_heads)
        dk, dv = int(hf.linear_key_head_dim), int(hf.linear_value_head_dim)
        if nv % nk:
            raise ValueError(
                f"linear_num_value_heads ({nv}) must be a multiple of linear_num_key_heads ({nk})"
            )
        self.nk = divide(nk, "linear_num_key_heads", tp)
        self.nv = divide(nv, "linear_num_value_heads", tp)
        self.dk, self.dv = dk, dv
        self.taps = int(hf.linear_conv_kernel_dim)
        self.channels = 2 * self.nk * dk + self.nv * dv
        self.conv_numel = (self.taps - 1) * self.channels
        super().__init__(self.conv_numel + self.nv * dk * dv, prefix, config)
        hidden = int(hf.hidden_size)
        self.in_proj = GatedDeltaNetInProj(hidden, nk, nv, dk, dv)
        full_channels = [nk * dk, nk * dk, nv * dv]
        self.conv1d = ConvWeight(self.channels, self.taps)
        self.conv1d.weight.weight_loader = _head_slices_loader(full_channels)
        self.A_log = nn.Parameter(torch.empty(self.nv), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.nv), requires_grad=False)
        self.A_log.weight_loader = self.dt_bias.weight_loader = _head_slices_loader([nv])
        self.norm = GatedRMSNorm(dv, float(hf.rms_norm_eps))
        self.out_proj = RowParallelLinear(nv * dv, hidden, False, what="linear attention width")

    def mix(self, x: torch.Tensor, states: torch.Tensor, md: RecurrentMetadata) -> torch.Tensor:
        """`x` is the layer's normed hidden states `[T, hidden]`; returns `out_proj`'s output."""
        num_tokens = x.shape[0]
        proj = self.in_proj(x)
        if (out := self._decode_step(proj, states, md)) is not None:
            return self.out_proj(out)
        mixed, z, b, a = proj.split([self.channels, self.nv * self.dv, self.nv, self.nv], dim=-1)
        beta = torch.sigmoid(b).float()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        core = torch.empty(num_tokens, self.nv, self.dv, dtype=torch.float32, device=x.device)
        kept = None
        if any(md.keep_token_states):
            kept = md.token_states.setdefault(
                self.layer_name,
                torch.zeros(num_tokens, self.state_numel, dtype=states.dtype, device=x.device),
            )
        decode: list[int] = []
        for i in range(md.num_reqs):
            start, end = md.query_start_loc[i], md.query_start_loc[i + 1]
            if end - start == 1 and not md.keep_token_states[i]:
                decode.append(i)
            elif end > start:
                keep = kept[start:end] if kept is not None and md.keep_token_states[i] else None
                core[start:end] = self._run(
                    mixed[start:end], g[start:end], beta[start:end], states, md.state_slots[i], keep
                )
        if decode:
            self._decode(mixed, g, beta, states, md, decode, core)
        out = self.norm(core.to(x.dtype), z.reshape(num_tokens, self.nv, self.dv))
        return self.out_proj(out.reshape(num_tokens, self.nv * self.dv))

    def _decode_step(
        self, proj: torch.Tensor, states: torch.Tensor, md: RecurrentMetadata
    ) -> torch.Tensor | None:
        """A step of decode tokens only (one per request, none keeping token states): the
        whole step up to `out_proj` in one C call (`gated_delta_decode_step`), where it
        applies; None otherwise (the general path then runs)."""
        qsl = md.query_start_loc
        if any(md.keep_token_states) or qsl != list(range(md.num_reqs + 1)):
            return None
        rows, slots = md.graph_rows, md.graph_slots
        if rows is None or slots is None:  # eager: this step's own index tensors
            if md.state_slots and not 0 <= min(md.state_slots) <= max(md.state_slots) < len(states):
                raise ValueError(
                    f"state slots must lie in [0, {len(states)}), got {md.state_slots}"
                )
            rows, slots = index_tensor(qsl[:-1]), index_tensor(md.state_slots)
        out = proj.new_empty(proj.shape[0], self.nv * self.dv)
        done = gated_delta_decode_step(
            proj, rows, states, slots, self.conv1d.weight.view(self.channels, -1),
            self.A_log, self.dt_bias, self.norm.weight, self.norm.eps, out,
            (self.nk, self.nv, self.dk, self.dv),
        )  # fmt: skip
        return out if done else None

    def _qkv(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split conv outputs `[n, channels]` into normalised q, k `[n, nk, dk]` and v."""
        n, kd = conv_out.shape[0], self.nk * self.dk
        q, k, v = conv_out.float().split([kd, kd, self.nv * self.dv], dim=-1)
        q = l2_normalize(q.reshape(n, self.nk, self.dk)) * self.dk**-0.5
        k = l2_normalize(k.reshape(n, self.nk, self.dk))
        return q, k, v.reshape(n, self.nv, self.dv)

    def _per_value_head(self, x: torch.Tensor) -> torch.Tensor:
        return x.repeat_interleave(self.nv // self.nk, dim=1)

    def _run(
        self,
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        states: torch.Tensor,
        slot: int,
        kept: torch.Tensor | None,
    ) -> torch.Tensor:
        """One request's tokens from its slot's state (chunked, or per token into `kept`)."""
        n, taps = mixed.shape[0], self.taps - 1
        row = states[slot]
        conv_state = row[: self.conv_numel].view(taps, self.channels)
        window = torch.cat([conv_state, mixed.to(states.dtype)])
        weight = self.conv1d.weight.squeeze(1).to(states.dtype)
        q, k, v = self._qkv(causal_conv(window, weight, n))
        q, k = self._per_value_head(q), self._per_value_head(k)
        state = row[self.conv_numel :].view(self.nv, self.dk, self.dv)
        if kept is None:
            out, final = chunked_gated_delta_rule(q, k, v, g, beta, state)
        else:
            out, final = recurrent_gated_delta_rule(
                q, k, v, g, beta, state, kept[:, self.conv_numel :]
            )
            for t in range(n):  # the conv state after each token: its last K - 1 inputs
                kept[t, : self.conv_numel] = window[t + 1 : t + 1 + taps].flatten()
        conv_state.copy_(window[n:])
        state.copy_(final)
        return out

    def _decode(
        self,
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        states: torch.Tensor,
        md: RecurrentMetadata,
        reqs: list[int],
        core: torch.Tensor,
    ) -> None:
        """One token each for requests `reqs`: the conv batched, the delta rule in place."""
        n, taps = len(reqs), self.taps - 1
        rows = [md.query_start_loc[i] for i in reqs]
        slot_list = [md.state_slots[i] for i in reqs]
        slots = torch.tensor(slot_list, device=mixed.device)
        conv_part = states.narrow(1, 0, self.conv_numel)
        conv_states = _rows(conv_part, slot_list).view(n, taps, self.channels)
        window = torch.cat([conv_states, _rows(mixed, rows)[:, None].to(states.dtype)], dim=1)
        weight = self.conv1d.weight.squeeze(1).to(states.dtype)
        conv_out = F.silu((window * weight.t()).sum(dim=1))
        _put_rows(conv_part, slot_list, window[:, 1:].flatten(1))
        q, k, v = self._qkv(conv_out)
        g, beta = _rows(g, rows), _rows(beta, rows)
        out = gated_delta_decode(states, self.conv_numel, slots, q, k, v, g, beta)
        if out is None:
            ssm_part = states.narrow(1, self.conv_numel, self.state_numel - self.conv_numel)
            state = _rows(ssm_part, slot_list).view(n, self.nv, self.dk, self.dv).float()
            qv, kv = self._per_value_head(q), self._per_value_head(k)
            out, state = delta_rule_step(state, qv, kv, v, g, beta)
            _put_rows(ssm_part, slot_list, state.flatten(1).to(states.dtype))
        _put_rows(core, rows, out)

    def extra_repr(self) -> str:
        return (
            f"key_heads={self.nk}, value_heads={self.nv}, dk={self.dk}, dv={self.dv}, "
            f"conv={self.taps}, state_numel={self.state_numel}"
        )
