"""`FusedMoE`: the routed experts of one MoE layer, stacked, sharded per DP rank, loadable.

The router's *logits* are computed by the model (it owns the `gate` linear, whose checkpoint
name differs per family); this layer turns logits into top-k weights, runs its experts and,
under data parallelism, exchanges tokens with the other ranks so that each rank's experts see
every rank's tokens. The exchange needs the step's token counts of every rank, which only the
forward context knows: that is why this layer, unlike the rest of `tokenwise.layers`, reads it.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenwise.config import EngineConfig
from tokenwise.distributed.tp_state import get_tp_size, tp_all_reduce
from tokenwise.forward_context import get_forward_context, is_forward_context_available
from tokenwise.layers.fused_moe.moe_methods import UNQUANTIZED_MOE, WEIGHT_ONLY_MOE
from tokenwise.layers.fused_moe.router import GroupedRouting, select_experts
from tokenwise.layers.fused_moe.sharding import ExpertShard
from tokenwise.layers.quantization.base_config import FusedMoEMethodBase, method_at_build
from tokenwise.layers.quantization.weight_only import QuantizedExperts
from tokenwise.layers.weight_utils import CheckpointTensor, check_full_shape, copy_checked

# The checkpoints' `hidden_act` values the experts run (gpt-oss's clamped SwiGLU has a layer
# of its own, `biased.py`).
HF_EXPERT_ACTIVATIONS = ("silu", "swish", "gelu_pytorch_tanh")


class FusedMoE(nn.Module):
    """Routed experts (SwiGLU, or GeGLU: `hidden_act`), stored as `w13_weight [E_l, 2*I_l, H]`, `w2_weight [E_l, H, I_l]`.

    `weights_in_fp32`: scale expert outputs by the float32 routing weights (Mixtral) instead of
    weights rounded to the activation dtype (Qwen-MoE); it matters only below fp32. `routing`:
    DeepSeek's grouped / biased / scaled top-k (None: plain softmax top-k).
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        config: EngineConfig,
        *,
        renormalize: bool,
        hidden_act: str = "silu",
        weights_in_fp32: bool = False,
        prefix: str = "",
        routing: GroupedRouting | None = None,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        if routing is not None:
            routing.check(num_experts, top_k)
        self.routing = routing
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.renormalize = renormalize
        self.weights_in_fp32 = weights_in_fp32
        self.layer_name = prefix
        self.parallel = config.parallel
        self.tp_size = get_tp_size()
        self.shard = ExpertShard.for_rank(config.parallel, num_experts, intermediate_size)
        if hidden_act not in HF_EXPERT_ACTIVATIONS:
            raise NotImplementedError(
                f"MoE experts support hidden_act {', '.join(HF_EXPERT_ACTIVATIONS)}; "
                f"got {hidden_act!r}"
            )
        self.activation = hidden_act
        local_e, local_i = self.shard.num_local_experts, self.shard.local_intermediate_size
        # The experts' method (`moe_methods`): the model's quantization config's, else dense
        # (until a config hands the layer int8 / int4 experts: `use_quantized_experts`).
        method = method_at_build(self, prefix) or UNQUANTIZED_MOE
        if not isinstance(method, FusedMoEMethodBase):
            raise TypeError(f"MoE layer {prefix!r} got {method!r}, not a FusedMoEMethodBase")
        self.quant_method: FusedMoEMethodBase = method
        self.quant_experts: QuantizedExperts | None = None
        method.create_weights(self, local_e, hidden_size, local_i)

    def use_quantized_experts(self, experts: QuantizedExperts) -> None:
        """Compute with `experts` from now on; the dense weights move to the meta device (their
        shapes still answer)."""
        self.quant_experts = experts
        self.quant_method = WEIGHT_ONLY_MOE
        for attr in ("w13_weight", "w2_weight"):
            dense = getattr(self, attr)
            meta = torch.empty(dense.shape, dtype=dense.dtype, device="meta")
            setattr(self, attr, nn.Parameter(meta, requires_grad=False))

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """The full MoE output for this rank's tokens: the DP exchange, then the TP sum."""
        partial = self.forward_partial(hidden_states, router_logits)
        # Every TP rank has the same tokens and another slice of the experts: add them up.
        return tp_all_reduce(partial) if self.tp_size > 1 else partial

    def forward_partial(
        self, hidden_states: torch.Tensor, router_logits: torch.Tensor
    ) -> torch.Tensor:
        """This TP rank's share of the output for this DP rank's tokens (the whole output
        without TP): the experts' partial sums, exchanged with the other DP ranks if sharded
        over them. A model that adds more TP-partial terms (a shared expert) all-reduces once."""
        if torch.compiler.is_compiling():
            # A ContextVar read cannot be traced; compiled code assumes no DP, like attention.
            if self.parallel.data_parallel_size > 1:
                raise RuntimeError(
                    f"MoE layer {self.layer_name!r} is sharded over DP ranks and cannot be "
                    "compiled: its token exchange reads the forward context"
                )
            return self.forward_local(hidden_states, router_logits)
        if is_forward_context_available():
            dp_metadata = get_forward_context().dp_metadata
            if dp_metadata is not None:
                from tokenwise.distributed.moe_dispatch import naive_dispatch_combine

                return naive_dispatch_combine(
                    hidden_states, router_logits, self.forward_local, dp_metadata, self.parallel
                )
        if self.parallel.data_parallel_size > 1:
            raise RuntimeError(
                f"MoE layer {self.layer_name!r} holds only DP rank "
                f"{self.parallel.data_parallel_rank}'s share of its experts "
                f"(data_parallel_size={self.parallel.data_parallel_size}); it must run inside a "
                "forward context with DP metadata, which exchanges tokens between ranks"
            )
        return self.forward_local(hidden_states, router_logits)

    def forward_local(
        self, hidden_states: torch.Tensor, router_logits: torch.Tensor
    ) -> torch.Tensor:
        """This rank's partial output: the sum over the experts / intermediate slice it holds."""
        topk_weights, topk_ids = select_experts(
            router_logits, self.top_k, self.renormalize, self.routing
        )
        return self.run_experts(hidden_states, topk_weights, topk_ids)

    def run_experts(
        self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """This rank's experts on routed tokens (a model with its own routing calls this),
        through the layer's quantization method."""
        return self.quant_method.apply(self, hidden_states, topk_weights, topk_ids)

    def weight_loader(
        self,
        param: nn.Parameter,
        loaded_weight: CheckpointTensor,
        shard_id: str,
        expert_id: int | None,
    ) -> bool:
        """Copy this rank's part of one checkpoint tensor; False if it belongs to other ranks.

        Per-expert tensors (`expert_id` set): `w1` (gate) and `w3` (up) are `[I, H]`, `w2`
        (down) is `[H, I]`. Stacked tensors of all experts (`expert_id=None`, transformers 5):
        `w13` is `[E, 2*I, H]` (gate rows, then up rows) and `w2` is `[E, H, I]`. Only this
        rank's experts and intermediate slice are read (from a `LazyTensor`, only those bytes).
        """
        expected = self.w2_weight if shard_id == "w2" else self.w13_weight
        if shard_id not in ("w1", "w3", "w2", "w13") or param is not expected:
            raise ValueError(f"shard id {shard_id!r} does not fit this parameter of FusedMoE")
        s = self.shard
        size, hidden, cols = s.intermediate_size, self.hidden_size, s.intermediate_slice()
        local_size = s.local_intermediate_size
        if expert_id is None:
            experts = slice(s.first_expert, s.first_expert + s.num_local_experts)
            if shard_id == "w13":
                check_full_shape(loaded_weight, (s.num_experts, 2 * size, hidden))
                up_cols = slice(size + cols.start, size + cols.stop)
                gate, up = loaded_weight[experts, cols], loaded_weight[experts, up_cols]
                copy_checked(param, torch.cat([gate, up], dim=1))
            elif shard_id == "w2":
                check_full_shape(loaded_weight, (s.num_experts, hidden, size))
                copy_checked(param, loaded_weight[experts, :, cols])
            else:
                raise ValueError(f"a stacked expert tensor cannot be shard {shard_id!r}")
            return True
        if shard_id == "w13":
            raise ValueError("a per-expert tensor cannot be shard 'w13'")
        check_full_shape(loaded_weight, (hidden, size) if shard_id == "w2" else (size, hidden))
        local = s.local_expert(expert_id)
        if local is None:
            return False
        if shard_id == "w2":
            copy_checked(param[local], loaded_weight[:, cols])
        else:
            rows = slice(0, local_size) if shard_id == "w1" else slice(local_size, 2 * local_size)
            copy_checked(param[local, rows], loaded_weight[cols])
        return True

    def extra_repr(self) -> str:
        s = self.shard
        return (
            f"experts={s.first_expert}..{s.first_expert + s.num_local_experts - 1} of "
            f"{self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
            f"intermediate={s.intermediate_start}..{s.intermediate_start + s.local_intermediate_size}"
            f" of {s.intermediate_size}, renormalize={self.renormalize}"
        )
