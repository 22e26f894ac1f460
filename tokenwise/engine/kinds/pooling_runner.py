"""An embedding model's part of the runner: one forward pass over whole prompts, then pooling.

The runner (`model_runner.py`) runs the step as for any model, and this part swaps its end: the same
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
from tokenwise.runner.input_batch import StepInputs
from tokenwise.runner.kind_part import RunnerKindPart

logger = logging.getLogger(__name__)


class PoolingRunnerPart(RunnerKindPart):
    needs_kv_cache = False  # encoder-only attention keeps nothing between steps

    def setup(self) -> None:
        runner = self.runner
        model_config = runner.model_config
        pooler_config = model_config.pooler_config
        if pooler_config is None:
            raise ValueError("an embedding model needs ModelConfig.pooler_config (task='embed')")
        self.pooler = Pooler(pooler_config)
        # A sequence classifier (tasks score / classify) puts the pooled rows through its head.
        self.head = None
        if model_config.task != "embed":
            classify = getattr(runner.model, "classify", None)
            if classify is None:
                raise ValueError(
                    f"task={model_config.task!r} needs a classification head, and "
                    f"{type(runner.model).__name__} has none"
                )
            self.head = ClassifierHead(classify, model_config.hf_config)
        if runner.cache_layers():
            raise ValueError(
                f"{type(runner.model).__name__} has attention layers with a KV cache; the "
                "pooling runner serves encoder-only models"
            )
        logger.info("pooling %s, normalize=%s", self.pooler.pooling_type, self.pooler.normalize)

    def begin_step(self, scheduler_output: SchedulerOutput) -> None:
        """Every scheduled prompt is encoded whole, in one pass."""
        for item in scheduler_output.scheduled:
            if item.num_computed_tokens or item.num_new_tokens != item.num_tokens:
                raise RuntimeError(
                    f"request {item.req_id}: an encoder step must hold its whole prompt "
                    f"({item.num_tokens} tokens), got {item.num_new_tokens} after "
                    f"{item.num_computed_tokens}"
                )

    @torch.inference_mode()
    def finish_step(self, step: StepInputs, hidden: torch.Tensor) -> ModelRunnerOutput:
        """One embedding per request, in the step's order, instead of sampling."""
        params = [st.kind_inputs.get("pooling_params") for st in step.states]
        normalize = [None if p is None else p.normalize for p in params]
        pooled = self.pooler(hidden, step.query_lens_np.tolist(), normalize)
        if self.head is not None and step.num_reqs:
            pooled = self.head(pooled)
        return ModelRunnerOutput(
            [], [], None, step.num_tokens, pooled_requests=step.scheduled, pooler_output=pooled
        )
