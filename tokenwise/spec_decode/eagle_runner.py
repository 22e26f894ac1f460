"""An EAGLE (or MTP) head's forward passes: the draft runner's KV cache and layout, the head's inputs.

`EagleRunner` is a `DraftRunner` (its own KV cache addressed by the target's block ids plus
scratch blocks, its own forward context, the same pass layout) whose model is an EAGLE head
built here from the head's checkpoint and the loaded target (whose embedding and, for EAGLE-1,
LM head it shares). A pass takes, beside each sequence's tokens, one feature row per token (the
target's, already fused by the head's `combine`, or the head's own from the pass before) and
returns each sampling sequence's greedy token with the row to feed back for the next draft.

The checks that make a bad head an error naming the field live here, where both configs are
known: the head's hidden size against the target's, and EAGLE-3's `d2t` table when its draft
vocabulary is smaller than the target's.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenwise.config import CUDAGraphMode, EngineConfig
from tokenwise.forward_context import create_forward_context, override_forward_context
from tokenwise.loader import (
    _build_in,
    _check_complete,
    iterate_safetensors,
    safetensors_files,
    safetensors_names,
)
from tokenwise.models.deepseek_mtp import DeepSeekMTPHead
from tokenwise.models.deepseek_v2 import DeepseekV2ForCausalLM
from tokenwise.models.llama_eagle import EagleLlamaHead, strip_model_prefix
from tokenwise.models.llama_eagle3 import Eagle3LlamaHead, eagle3_aux_layers
from tokenwise.models.qwen3_next import Qwen3NextForCausalLM
from tokenwise.models.qwen3_next_mtp import Qwen3NextMTPHead, has_mtp_head
from tokenwise.spec_decode.draft_runner import DraftRunner, DraftSeq
from tokenwise.spec_decode.gguf_mtp import load_gguf_mtp_head


class EagleRunner(DraftRunner):
    def __init__(
        self,
        target: EngineConfig,
        target_model: nn.Module,
        device: str | torch.device = "cpu",
    ) -> None:
        spec = target.speculative
        assert spec is not None and target.model is not None
        compilation = target.compilation
        if compilation.use_compile or compilation.cudagraph_mode != CUDAGraphMode.NONE:
            raise ValueError(
                f"speculative_config.method {spec.method!r} runs eagerly only: turn compilation "
                "and CUDA graphs off (enforce_eager=True)"
            )
        if target.parallel.pipeline_parallel_size > 1:
            raise ValueError(
                f"speculative_config.method {spec.method!r} does not run under "
                f"pipeline_parallel_size={target.parallel.pipeline_parallel_size}"
            )
        self.method = spec.method
        self.target_model = target_model
        self.target_hf = target.model.hf_config
        # EAGLE-3 reads these target layers' inputs (None: EAGLE-1 reads the last hidden state).
        self.aux_layers: tuple[int, ...] | None = None
        # MTP's module is in the target's own checkpoint unless `model` names another.
        head_dir = spec.model or target.model.model
        super().__init__(target, head_dir, device)

    def _load_model(self, draft_dir: str) -> nn.Module:
        if self.config.model.load_format == "gguf":  # MTP of the target's own GGUF file
            return load_gguf_mtp_head(self.config, self.target_model, self.device)
        head_hf = self.config.model.hf_config
        where = f"speculative_config.model {draft_dir!r}"
        target_h = int(self.target_hf.hidden_size)
        files = safetensors_files(draft_dir)
        names = {strip_model_prefix(n) for n in safetensors_names(files)}
        with _build_in(self.config.model.dtype, self.device):
            if self.method == "mtp":
                head: nn.Module = self._mtp_head(where, safetensors_names(files))
            elif self.method == "eagle":
                if int(head_hf.hidden_size) != target_h:
                    raise ValueError(
                        f"{where}: the EAGLE head's hidden_size is {head_hf.hidden_size}, the "
                        f"target's is {target_h}; an EAGLE-1 head must match the target"
                    )
                head = EagleLlamaHead(self.config, self.target_model, fc_bias="fc.bias" in names)
            else:
                head_target_h = int(getattr(head_hf, "target_hidden_size", None) or 0) or int(
                    head_hf.hidden_size
                )
                if head_target_h != target_h:
                    field = (
                        "target_hidden_size"
                        if getattr(head_hf, "target_hidden_size", None)
                        else "hidden_size"
                    )
                    raise ValueError(
                        f"{where}: the EAGLE-3 head's {field} is {head_target_h}, the target's "
                        f"hidden_size is {target_h}"
                    )
                draft_vocab = int(getattr(head_hf, "draft_vocab_size", None) or 0)
                draft_vocab = draft_vocab or int(head_hf.vocab_size)
                if draft_vocab != int(head_hf.vocab_size) and "d2t" not in names:
                    raise ValueError(
                        f"{where}: the EAGLE-3 head's draft_vocab_size is {draft_vocab}, "
                        f"smaller than the target's vocabulary ({head_hf.vocab_size}), but its "
                        "checkpoint has no d2t tensor mapping draft ids to target ids"
                    )
                self.aux_layers = eagle3_aux_layers(head_hf, int(self.target_hf.num_hidden_layers))
                head = Eagle3LlamaHead(
                    self.config, self.target_model, target_h, "embed_tokens.weight" in names
                )
        try:
            _check_complete(head, head.load_weights(iterate_safetensors(files)))
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from exc
        return head.eval().requires_grad_(False)

    def _mtp_head(self, where: str, names: set[str]) -> nn.Module:
        """DeepSeek-V3's MTP module, from `model.layers.{num_hidden_layers}` of the checkpoint,
        or Qwen3-Next's / Qwen3.5's, from its `mtp.*` tensors."""
        hf = self.config.model.hf_config
        if isinstance(self.target_model, Qwen3NextForCausalLM):
            if not has_mtp_head(names):
                raise ValueError(
                    f"{where}: speculative_config.method 'mtp' needs a checkpoint with an MTP "
                    f"head (mtp.* tensors); this {type(self.target_model).__name__} checkpoint "
                    "has none"
                )
            return Qwen3NextMTPHead(self.config, self.target_model)
        if not isinstance(self.target_model, DeepseekV2ForCausalLM):
            raise ValueError(
                "speculative_config.method 'mtp' runs the MTP module of DeepSeek-V3, Qwen3-Next "
                f"and Qwen3.5 checkpoints; the target is {type(self.target_model).__name__}"
            )
        count = int(getattr(hf, "num_nextn_predict_layers", 0) or 0)
        index = int(hf.num_hidden_layers)
        if count < 1 or not any(n.startswith(f"model.layers.{index}.") for n in names):
            raise ValueError(
                f"{where}: speculative_config.method 'mtp' needs a checkpoint with an MTP module "
                f"(num_nextn_predict_layers >= 1, model.layers.{index}.* tensors); its "
                f"num_nextn_predict_layers is {count}"
            )
        own_embedding = f"model.layers.{index}.embed_tokens.weight" in names
        return DeepSeekMTPHead(
            self.config, self.target_model, self.target_model.is_v3, own_embedding
        )

    def combine(self, target_rows: torch.Tensor) -> torch.Tensor:
        """The target's rows as the head's feature rows (EAGLE-3: fused by `fc`)."""
        with torch.inference_mode():
            return self.model.combine(target_rows)

    @torch.inference_mode()
    def run_head(
        self, seqs: list[DraftSeq], features: list[torch.Tensor]
    ) -> tuple[list[int], list[torch.Tensor]]:
        """One pass; per sampling sequence (in the order of `seqs`) its greedy token and the
        `[1, h]` row to feed back with it."""
        p = self.lay_out(seqs)
        hidden = torch.cat([features[i] for i in p.order])
        with override_forward_context(create_forward_context(p.metadata, self.config)):
            for_logits, for_next = self.model(p.input_ids, p.positions, hidden)
        if not p.sample_rows.numel():
            return [], []
        picked = self.model.greedy(for_logits.index_select(0, p.sample_rows), self.vocab_size)
        rows = for_next.index_select(0, p.sample_rows)
        tokens = p.in_seq_order(picked.tolist())
        fed = p.in_seq_order([rows[r : r + 1] for r in range(rows.shape[0])])
        return tokens, fed


__all__ = ["EagleRunner"]
