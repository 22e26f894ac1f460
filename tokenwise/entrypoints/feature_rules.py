"""Which features combine: one table of refusals, walked once when a config is created.

Each row names two features and a rule that refuses their combination with the message a user
sees (naming the settings, saying what to do instead). `EngineArgs.create_engine_config` walks
the rows in order once the model's kind is known and before any engine part is built; the
first row that refuses raises ValueError. A new feature that does not combine with another is
one row here, not a check in the module that implements it.

Checks that are not pure functions of the settings and the model's kind stay where their
facts are known, and are listed here so a reader finds them:
- `distributed.pp_launch.check_pipeline_config`: pipeline stages against the model's layer
  count, the model class's `supports_pp` / `check_pipeline_split`, the KV block split and the
  *resolved* compile / graph mode, at launch (also for configs built by hand);
- `runner.graph_setup.check_cudagraph_config`: the graph mode against the attention backend
  the device selects;
- `engine.speculative_setup.make_drafter`: speculation against the model kind the engine
  actually built (a guard behind the row below);
- `engine_config.resolve_cudagraph_mode`: a graph mode against device, eagerness and MoE
  host reads, which are derived there;
- the draft model's vocabulary and an EAGLE head's hidden size, read when they load;
- `distributed.ubatching`: micro-batch splits of one step's tokens (per step, not config);
- `engine.async_step.check_async_engine`: async scheduling against a model with recurrent
  state (known once the KV-cache groups are built); `engine.async_scheduler` refuses a
  guided-decoding request (per request, not config) under async scheduling.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenwise.config import SPEC_MODEL_METHODS, SpeculativeConfig
from tokenwise.quantization_config import uses_cpu_kernels


@dataclass(frozen=True)
class Features:
    """What the rules read: the settings as given, and the model's kind as resolved."""

    args: Any  # EngineArgs
    model: Any  # ModelConfig, task resolved
    device: str
    enforce_eager: bool  # as asked, or the device's default
    encoder_decoder: bool
    multimodal: bool
    speculative: SpeculativeConfig | None

    @property
    def pooling(self) -> bool:
        return bool(self.model.is_pooling)

    @property
    def multi_rank(self) -> bool:
        return self.args.data_parallel_size != 1 or self.args.tensor_parallel_size != 1

    def ranks(self) -> str:
        return f"{self.args.data_parallel_size} and {self.args.tensor_parallel_size}"


@dataclass(frozen=True)
class Rule:
    """Feature A with feature B: refused when `refuses` holds, with `message`."""

    feature: str
    other: str
    refuses: Callable[[Features], bool]
    message: Callable[[Features], str]


def _graphs_asked(f: Features) -> bool:
    mode = f.args.cudagraph_mode
    return mode is not None and str(getattr(mode, "name", mode)).upper() != "NONE"


def _fp8_cache(f: Features) -> bool:
    return str(f.args.kv_cache_dtype).startswith("fp8")


def _not_text_decoder(f: Features) -> bool:
    return f.pooling or f.encoder_decoder or f.multimodal


def _async(f: Features) -> bool:
    return bool(f.args.async_scheduling)


# Async scheduling (`engine/async_step.py`) is built for one text decoder on one rank: the
# scheduler runs one step ahead of the runner, which these features cannot follow yet.
_ASYNC = "async_scheduling=True (--async-scheduling)"
ASYNC_RULES: tuple[Rule, ...] = (
    Rule(
        _ASYNC,
        "speculative decoding",
        lambda f: _async(f) and f.speculative is not None,
        lambda f: (
            f"{_ASYNC} does not run with speculative_config yet: the drafts of step N+1 "
            "would be proposed before step N's tokens are known; drop one of the two"
        ),
    ),
    Rule(
        _ASYNC,
        "pooling, encoder-decoder and vision-language models",
        lambda f: _async(f) and _not_text_decoder(f),
        lambda f: (
            f"{_ASYNC} applies to text-only decoder generation models, not to "
            f"{', '.join(f.model.architectures)}"
        ),
    ),
    Rule(
        _ASYNC,
        "pipeline parallelism",
        lambda f: _async(f) and f.args.pipeline_parallel_size > 1,
        lambda f: (
            f"{_ASYNC} does not combine with pipeline_parallel_size="
            f"{f.args.pipeline_parallel_size}: the pipeline already keeps one batch per "
            "stage in flight"
        ),
    ),
    Rule(
        _ASYNC,
        "data / tensor parallelism",
        lambda f: _async(f) and f.multi_rank,
        lambda f: (
            f"{_ASYNC} runs on one rank for now: data_parallel_size and "
            f"tensor_parallel_size must be 1, got {f.ranks()}"
        ),
    ),
    Rule(
        _ASYNC,
        "LoRA (enable_lora)",
        lambda f: _async(f) and f.args.enable_lora,
        lambda f: (
            f"{_ASYNC} does not run with enable_lora yet: adapters are loaded into their "
            "slots between steps, and with async scheduling a step is always running"
        ),
    ),
    Rule(
        _ASYNC,
        "the KV tier (kv_offloading_size)",
        lambda f: _async(f) and f.args.kv_offloading_size is not None,
        lambda f: (
            f"{_ASYNC} does not run with kv_offloading_size yet: tier loads are not "
            "ordered with a step in flight"
        ),
    ),
)


RULES: tuple[Rule, ...] = (
    Rule(
        "quantization with CPU kernels",
        "torch.compile (enforce_eager=False)",
        lambda f: uses_cpu_kernels(f.model.quantization, f.device) and not f.enforce_eager,
        lambda f: (
            f"quantization={f.model.quantization!r} runs its CPU kernels eagerly "
            "(torch.compile does not trace them): leave enforce_eager at its default or True"
        ),
    ),
    Rule(
        "fp8 KV cache",
        "pooling models",
        lambda f: _fp8_cache(f) and f.pooling,
        lambda f: (
            f"kv_cache_dtype={f.args.kv_cache_dtype!r} is not supported for "
            f"task={f.model.task!r} (pooling) models; use 'auto'"
        ),
    ),
    Rule(
        "fp8 KV cache",
        "encoder-decoder models",
        lambda f: _fp8_cache(f) and f.encoder_decoder,
        lambda f: (
            f"kv_cache_dtype={f.args.kv_cache_dtype!r} is not supported for "
            "encoder-decoder models; use 'auto'"
        ),
    ),
    Rule(
        "override_pooler_config",
        "classifiers (task score / classify)",
        lambda f: (
            f.pooling and f.model.task != "embed" and f.args.override_pooler_config is not None
        ),
        lambda f: (
            "override_pooler_config applies to task='embed' models only: a classifier "
            "pools as it was trained (its head reads [CLS], or the last token)"
        ),
    ),
    Rule(
        "pooling tasks",
        "data / tensor parallelism",
        lambda f: f.pooling and (f.args.data_parallel_size > 1 or f.args.tensor_parallel_size > 1),
        lambda f: (
            "pooling tasks (embed, score, classify) run on one rank: data_parallel_size "
            f"and tensor_parallel_size must be 1, got {f.ranks()}"
        ),
    ),
    Rule(
        "pooling tasks",
        "CUDA graphs",
        lambda f: f.pooling and _graphs_asked(f),
        lambda f: (
            "pooling tasks (embed, score, classify) run eagerly: cudagraph_mode must be "
            f"NONE, got {f.args.cudagraph_mode}"
        ),
    ),
    Rule(
        "override_pooler_config",
        "generation models",
        lambda f: not f.pooling and f.args.override_pooler_config is not None,
        lambda f: "override_pooler_config applies to task='embed' models only",
    ),
    Rule(
        "encoder-decoder models",
        "data / tensor parallelism",
        lambda f: f.encoder_decoder and f.multi_rank,
        lambda f: (
            "encoder-decoder models (BART, Whisper) run on one rank: data_parallel_size "
            f"and tensor_parallel_size must be 1, got {f.ranks()}"
        ),
    ),
    Rule(
        "vision-language models",
        "data / tensor parallelism",
        lambda f: f.multimodal and f.multi_rank,
        lambda f: (
            "vision-language models run on one rank: data_parallel_size and "
            f"tensor_parallel_size must be 1, got {f.ranks()} (Qwen3.5 and Gemma 4 "
            "checkpoints serve text alone, on several ranks, with limit_mm_per_prompt="
            '{"image": 0})'
        ),
    ),
    Rule(
        "vision-language models",
        "pooling tasks",
        lambda f: f.multimodal and f.pooling,
        lambda f: "vision-language models generate; task='embed' does not apply",
    ),
    Rule(
        "speculative decoding",
        "pooling, encoder-decoder and vision-language models",
        lambda f: f.speculative is not None and _not_text_decoder(f),
        lambda f: (
            "speculative_config applies to text-only decoder generation models, not to "
            f"{', '.join(f.model.architectures)}"
        ),
    ),
    Rule(
        "speculative decoding with a draft model (draft_model, eagle, eagle3, mtp)",
        "tensor parallelism",
        # The draft (or EAGLE / MTP head) runs on the driver alone, unsharded; its layers
        # would read the TP rank.
        lambda f: (
            f.speculative is not None
            and f.speculative.method in SPEC_MODEL_METHODS
            and f.args.tensor_parallel_size > 1
        ),
        lambda f: (
            f"speculative_config.method {f.speculative.method!r}: its draft model does "
            f"not run under tensor_parallel_size={f.args.tensor_parallel_size} yet (use data "
            "parallelism, where each rank runs its own draft, or method 'ngram')"
        ),
    ),
    *(
        Rule(
            "pipeline parallelism",
            other,
            lambda f, asked=asked: f.args.pipeline_parallel_size > 1 and asked(f),
            lambda f, setting=setting: (
                f"pipeline_parallel_size={f.args.pipeline_parallel_size} does not combine "
                f"with {setting} yet; run the pipeline on its own (no data parallelism, no "
                "drafts, no LoRA)"
            ),
        )
        for other, setting, asked in (
            ("data parallelism", "data_parallel_size", lambda f: f.args.data_parallel_size > 1),
            ("speculative decoding", "speculative_config", lambda f: f.speculative is not None),
            ("LoRA adapters", "enable_lora", lambda f: bool(f.args.enable_lora)),
        )
    ),
) + ASYNC_RULES


def check_features(features: Features) -> None:
    """Raise ValueError with the first refusing row's message."""
    for rule in RULES:
        if rule.refuses(features):
            raise ValueError(rule.message(features))
