"""Model kinds as strategies: what differs between generating, embedding and encoder-decoder.

There is one engine loop (`LLMEngine`): schedule, run, detokenize, apply stop rules, report. A
model kind supplies the four things that differ, and nothing else:

- its prompt processing: a prompt and parameters in, the requests to schedule out
  (`make_requests`; a generative request with `n > 1` is n sibling requests);
- its block manager over the runner's KV-cache groups (none for an encoder-only embedding
  model, self-attention groups for a decoder, plus cross-attention for an encoder-decoder
  model) and the capacity check of its pool (`check_kv_capacity`);
- its per-step extra inputs, through the runner part and scheduler class it names (`runner_part`,
  `scheduler_cls`): the encoder-decoder runner adds encoder inputs and cross metadata, the
  pooling runner pools instead of sampling;
- its outputs (`make_output`, and `record_pooled` for what a step pools).

A kind reads the engine's shared state (configuration, tokenizer, runner) through
`EngineContext`, a protocol the engine satisfies, so no kind imports the engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from tokenwise.config import EngineConfig
from tokenwise.engine.block_manager import BlockManager
from tokenwise.engine.output_processor import SampleOutput
from tokenwise.engine.prompts import PromptInput
from tokenwise.engine.request import Request
from tokenwise.engine.scheduler import Scheduler
from tokenwise.engine.step_outputs import ModelRunnerOutput
from tokenwise.lora.request import LoRARequest
from tokenwise.model_config import ModelConfig
from tokenwise.outputs import EmbeddingRequestOutput, RequestOutput
from tokenwise.runner.kind_part import RunnerKindPart
from tokenwise.runner.memory_profiling import check_kv_cache_holds_one_sequence
from tokenwise.runner.model_runner import ModelRunner
from tokenwise.sampling.guided.compiler import GrammarCompileCache


@dataclass
class NewRequest:
    """A caller's request as `LLMEngine.add_request` received it, for the kind to process."""

    request_id: str
    prompt: PromptInput
    params: Any = None  # SamplingParams, or PoolingParams for an embedding model
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None


class EngineContext(Protocol):
    """What a kind may read of the engine that owns it."""

    config: EngineConfig
    model_config: ModelConfig
    tokenizer: Any
    eos_token_ids: tuple[int, ...]
    runner: ModelRunner
    grammar_timeout_s: float

    def check_lora(self, lora_request: LoRARequest) -> None: ...

    def grammar_cache(self) -> GrammarCompileCache: ...


class ModelKind:
    """A kind of model as the engine sees it. One instance per engine, made by the engine."""

    name: ClassVar[str] = ""
    # What the kind adds to the runner's step (`runner/kind_part.py`): nothing for a decoder.
    runner_part: ClassVar[type[RunnerKindPart]] = RunnerKindPart
    scheduler_cls: ClassVar[type[Scheduler]] = Scheduler

    def __init__(self, engine: EngineContext) -> None:
        self.engine = engine

    # ---- KV cache ---------------------------------------------------------------------------

    def check_kv_capacity(self, num_blocks: int) -> None:
        """Raise unless the pool holds what one request may need (one full sequence, over
        every KV-cache group: a sliding-window group needs only its window's blocks)."""
        config, model = self.engine.config, self.engine.model_config
        layout = self.engine.runner.kv_cache_layout
        needed = layout.blocks_per_request(
            model.max_model_len, config.scheduler.max_num_batched_tokens
        )
        check_kv_cache_holds_one_sequence(
            num_blocks, config.cache.block_size, model.max_model_len, needed
        )

    def make_block_manager(self, num_blocks: int) -> BlockManager:
        """The block manager over the runner's KV-cache groups (one manager per group)."""
        runner = self.engine.runner
        return BlockManager(
            num_blocks,
            self.engine.config.cache.block_size,
            specs=runner.kv_cache_layout.specs,
            num_state_slots=runner.num_state_slots,
        )

    # ---- requests and outputs ---------------------------------------------------------------

    def make_requests(self, new: NewRequest) -> list[tuple[Request, SampleOutput]]:
        """Validate a caller's request and make the requests to schedule, each with its
        output state; raise on bad input."""
        raise NotImplementedError

    def prompt_settings(self) -> dict[str, int]:
        """What a front end without the model needs to process prompts as this kind does
        (an engine-core client gets it from its core); none for a text model."""
        return {}

    def record_pooled(self, result: ModelRunnerOutput) -> list[Request]:
        """Keep what a step pooled for its requests' outputs; the requests it pooled for."""
        return []

    def make_output(
        self, request_id: str, samples: list[Request], outs: list[SampleOutput]
    ) -> RequestOutput | EmbeddingRequestOutput:
        """The caller's output for `request_id`: what its samples (`outs`: their output
        states) produced since the last."""
        raise NotImplementedError

    def shutdown(self) -> None:
        """Release what the kind started (threads); the engine is going away."""


def timing_metrics(arrival: float, outs: list[SampleOutput], finished: bool) -> dict[str, float]:
    """Time to first token (the earliest sample's) and, once finished, end-to-end latency,
    from the request's `arrival_time` and its samples' `first_token_time`."""
    metrics: dict[str, float] = {}
    firsts = [o.first_token_time for o in outs if o.first_token_time is not None]
    if firsts:
        metrics["time_to_first_token"] = min(firsts) - arrival
    if finished:
        metrics["e2e_latency"] = time.monotonic() - arrival
    return metrics
