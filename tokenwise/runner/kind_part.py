"""What a model kind adds to the runner: a part the runner holds, not a subclass of it.

The runner is the same for every kind (decoder-only, embedding, encoder-decoder,
vision-language) and for every layout (one process, tensor parallel, a pipeline stage); a kind
that needs more from a step hands it a `RunnerKindPart` (`ModelKind.runner_part`), which the
runner calls at fixed points of a step:

- `setup()` once the model, input batch and graphs exist;
- `begin_step(scheduler_output)` before the step is laid out (a kind's own bookkeeping);
- `model_inputs(step, metadata)`: the model's extra keyword inputs (images, encoder inputs),
  adding the kind's fields to the attention metadata where needed;
- `may_replay_graphs(step)` and `forward_model(...)`: whether the step may replay graphs, and
  which module an eager step calls;
- `finish_step(step, hidden)`: an output that replaces logits and sampling (pooling), or None.

The base part adds nothing (decoder-only models). A part reads the runner it belongs to.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from tokenwise.engine.step_outputs import ModelRunnerOutput, SchedulerOutput
from tokenwise.runner.input_batch import StepInputs


class RunnerKindPart:
    """The decoder-only kind's part: nothing beyond the runner's own step."""

    # False for models whose attention keeps nothing between steps (encoder-only): the engine
    # then runs with zero KV blocks.
    needs_kv_cache: ClassVar[bool] = True

    def __init__(self, runner: Any) -> None:
        self.runner = runner

    def max_cross_blocks_per_seq(self) -> int:
        """The widest cross block table, for the graphs' cross buffers (0: no cross-attention).
        Asked before `setup`, while the graph runner is built."""
        return 0

    def setup(self) -> None:
        """What the kind adds once the model, batch and graphs exist."""

    def begin_step(self, scheduler_output: SchedulerOutput) -> None:
        """The kind's bookkeeping before a step is laid out."""

    def model_inputs(self, step: StepInputs, attn_metadata: Any) -> dict[str, Any]:
        """Extra keyword inputs of the model for this step (`attn_metadata`: by layer name,
        None while a FULL graph replays)."""
        return {}

    def may_replay_graphs(self, step: StepInputs) -> bool:
        """Whether this step may run through the graph dispatcher (else eagerly)."""
        return True

    def forward_model(self, model_kwargs: dict[str, Any] | None) -> Any:
        """What an eager step calls: the model (compiled, when compilation is on)."""
        return self.runner.model

    def finish_step(self, step: StepInputs, hidden: torch.Tensor) -> ModelRunnerOutput | None:
        """An output in place of logits and sampling, or None to sample as usual."""
        return None
