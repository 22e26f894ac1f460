"""The runner of an embedding model: one forward pass over whole prompts, then pooling.

It is the decoder runner (`model_runner.py`) with the end of the step swapped: the same
persistent input batch, the same attention metadata built from the step's buffers (encoder-only
attention reads only where sequences start and end from it), the same forward context; then,
instead of logits and sampling, each sequence's hidden states are pooled into one embedding (a
classifier's head then turns it into label probabilities: tasks score and classify).
Its attention layers keep no KV cache, so none is allocated: the engine runs with zero blocks.

Embedding models run eagerly (no torch.compile, no CUDA graphs: `EngineArgs.create_engine_config` says so)
and on one rank (tensor and data parallelism are refused there).
"""

from __future__ import annotations

import logging

import torch

from tokenwise.engine.step_outputs import ModelRunnerOutput, SchedulerOutput
from tokenwise.pooling.classifier import ClassifierHead
from tokenwise.pooling.pooler import Pooler
from tokenwise.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class PoolingModelRunner(ModelRunner):
    def _setup_kind(self) -> None:
        pooler_config = self.model_config.pooler_config
        if pooler_config is None:
            raise ValueError("an embedding model needs ModelConfig.pooler_config (task='embed')")
        self.pooler = Pooler(pooler_config)
        # A sequence classifier (tasks score / classify) puts the pooled rows through its head.
        self.head = None
        if self.model_config.task != "embed":
            classify = getattr(self.model, "classify", None)
            if classify is None:
                raise ValueError(
                    f"task={self.model_config.task!r} needs a classification head, and "
                    f"{type(self.model).__name__} has none"
                )
            self.head = ClassifierHead(classify, self.model_config.hf_config)
        if self.cache_layers():
            raise ValueError(
                f"{type(self.model).__name__} has attention layers with a KV cache; the "
                "pooling runner serves encoder-only models"
            )

    def determine_num_blocks(self) -> int:
        return 0  # encoder-only attention keeps nothing between steps

    def initialize_kv_cache(self, num_blocks: int) -> None:
        if num_blocks:
            raise ValueError(f"an encoder-only model has no KV cache, got {num_blocks} blocks")
        self.num_blocks = 0
        logger.info(
            "no KV cache: encoder-only model; pooling %s, normalize=%s",
            self.pooler.pooling_type,
            self.pooler.normalize,
        )

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Encode every scheduled prompt in one pass; one embedding per request, in order."""
        self.input_batch.remove_requests(scheduler_output.finished_req_ids)
        scheduled = list(scheduler_output.scheduled)
        for item in scheduled:
            req = item.request
            if req.num_computed_tokens or item.num_new_tokens != req.num_tokens:
                raise RuntimeError(
                    f"request {req.request_id}: an encoder step must hold its whole prompt "
                    f"({req.num_tokens} tokens), got {item.num_new_tokens} after "
                    f"{req.num_computed_tokens}"
                )
        step = self.input_batch.prepare(scheduled)
        attn_metadata = self._attn_metadata(step, self._metadata_tables(step))
        hidden = self._run_eager(step, attn_metadata)
        normalize = [
            None if s.request.pooling_params is None else s.request.pooling_params.normalize
            for s in scheduled
        ]
        pooled = self.pooler(hidden, step.query_lens_np.tolist(), normalize)
        if self.head is not None and len(scheduled):
            pooled = self.head(pooled)
        return ModelRunnerOutput(
            [], [], None, step.num_tokens, pooled_requests=scheduled, pooler_output=pooled
        )
