"""Prove that tokenwise's imports form layers: no upward import and no import circle.

    python -m tokenwise.tools.check_layers      # exit 0 when clean, 1 listing every offender

Why a check: an import circle hidden behind a function-level or `TYPE_CHECKING` import works
until someone hoists the import, and it already means that neither module can be read, tested
or replaced without the other. Writing the order down (`LAYERS`) and checking it on every test
run keeps circles from growing back.

The rules:

- Every module of the package belongs to one layer of `LAYERS`, by its most specific pattern.
  A module that matches no pattern is an error, so a new module gets a place on purpose.
- A module imports modules of its own layer or of lower layers only. Module-level,
  function-level and `if TYPE_CHECKING:` imports all count: a lazy import is still a
  dependency, and a type-only import still ties the two designs together.
- The imports among the modules of one layer form no cycle.
- Importing `a.b.c` also runs the `__init__` of `a` and `a.b`; those implicit imports are not
  counted (every module would otherwise depend on `tokenwise/__init__.py`, the top-level
  facade). Each package's `__init__` is checked as a module of its own instead.

The graph comes from `import_graph`, which parses source with `ast` and imports nothing of the
package, so the check also runs (and names the culprit) when the package no longer imports.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tokenwise.tools.import_graph import (
    ImportEdge,
    collect_imports,
    discover_modules,
    strongly_connected,
)

PACKAGE_DIR = Path(__file__).resolve().parents[1]
THIS_MODULE = "tokenwise.tools.check_layers"  # not __name__, which is "__main__" under -m


@dataclass(frozen=True)
class Layer:
    """A named set of module patterns: `a.b` is that module, `a.b.*` it and all below it."""

    name: str
    patterns: tuple[str, ...]


# Lowest first: a module may import its own layer and the layers above it in this list.
LAYERS: tuple[Layer, ...] = (
    # Plain settings and records with no tokenwise dependency; and this checker, which must
    # keep working when the rest of the package does not import. The GGUF readers are here
    # too (metadata -> a transformers config, tensors -> HF names, the tokenizer): they need
    # nothing else of tokenwise, and the model configuration reads them.
    Layer(
        "foundation",
        (
            "tokenwise.config",
            "tokenwise.compilation_config",
            "tokenwise.gguf.*",
            "tokenwise.quantization_config",
            "tokenwise.model_config",
            "tokenwise.platform",
            "tokenwise.outputs",
            "tokenwise.default_model",
            "tokenwise.envs",
            "tokenwise.batchsize_stats",
            "tokenwise.tools.*",
            # KV-cache specs and groups: plain data the layers declare and the runner and the
            # block manager both read.
            "tokenwise.kv_cache",
            "tokenwise.kv_cache.specs",
            "tokenwise.kv_cache.layout",
            "tokenwise.kv_cache.hashing",
            # KV-cache events: the wire structs and `--kv-events-config` (msgspec, no engine).
            "tokenwise.kv_cache.events",
            "tokenwise.kv_cache.events_config",
            # The second KV tier's stores and its connector to the cache tensors (torch only).
            "tokenwise.kv_cache.tier",
            "tokenwise.kv_cache.tier_disk",
            "tokenwise.kv_cache.tier_blocks",
        ),
    ),
    # The C kernels of CPU decode, their ctypes wrappers and build: tensors and plain settings
    # in, tensors out; the layers, attention backends and CPU graphs call them.
    Layer("native kernels", ("tokenwise.native.*",)),
    # Tensor-parallel rank, size and collectives: what parallel layers read at construction;
    # the pipeline stage and its layer range, which models read at construction.
    Layer(
        "process groups",
        (
            "tokenwise.distributed.rendezvous",
            "tokenwise.distributed.tp_state",
            "tokenwise.distributed.pp_state",
        ),
    ),
    # Plain PyTorch building blocks and weight-copy helpers: no engine state, no context.
    Layer("layers", ("tokenwise.layers.*",)),
    # The DP group and batch coordination, which the forward context calls into.
    Layer("distributed", ("tokenwise.distributed.*",)),
    # Per-pass context and the static layer registry the attention layers enter themselves in.
    Layer("forward context", ("tokenwise.forward_context", "tokenwise.layer_registry")),
    # The MoE layer: under DP it reads the step's token counts from the forward context and
    # exchanges tokens through `distributed`, so it sits above both (the rest of `layers` not).
    # Its dispatch/combine lives in `distributed` by topic but reads DPMetadata, so it is here.
    Layer("MoE layer", ("tokenwise.layers.fused_moe.*", "tokenwise.distributed.moe_dispatch")),
    Layer("attention utils", ("tokenwise.attention", "tokenwise.attention.utils")),
    # Batch structure for attention and the persistent graph buffers: what backends consume.
    Layer(
        "attention metadata",
        (
            "tokenwise.attention.metadata",
            "tokenwise.attention.graph_state",
            "tokenwise.attention.ubatch_metadata",
        ),
    ),
    # Tensor-only kernels: they receive tensors, metadata and plain settings, never the layer.
    Layer("attention backends", ("tokenwise.attention.backends.*",)),
    Layer(
        "attention layer",
        (
            "tokenwise.attention.layer",
            "tokenwise.attention.mla",
            "tokenwise.attention.recurrent",
            "tokenwise.attention.kv_scales",
        ),
    ),
    Layer("models", ("tokenwise.models.*",)),
    # Resolves the model class from the registry, so it sits above the models.
    Layer("loader", ("tokenwise.loader",)),
    # Adapter slots attached to a built model's linear layers, and the PEFT reader.
    Layer("LoRA", ("tokenwise.lora.*",)),
    # Sampling, and speculative decoding's proposers (token ids in, draft token ids out).
    Layer("sampling", ("tokenwise.sampling.*", "tokenwise.spec_decode.*")),
    # Embedding models: pooling parameters and the pooler; the task check reads the registry.
    Layer("pooling", ("tokenwise.pooling.*",)),
    Layer("compilation", ("tokenwise.compilation.*",)),
    # What the scheduler owns and hands the runner: requests, block tables, stop rules, the
    # step's records; and the model kinds' request-side pieces below the runner that reads
    # them (their request types, encoder inputs, their schedulers).
    Layer(
        "requests and scheduling",
        (
            "tokenwise.engine",
            "tokenwise.engine.request",
            "tokenwise.engine.step_outputs",
            "tokenwise.engine.block_pool",
            "tokenwise.kv_cache.managers",
            "tokenwise.kv_cache.invariants",
            "tokenwise.engine.block_manager",
            "tokenwise.engine.kv_tier_setup",
            "tokenwise.engine.request_queue",
            "tokenwise.engine.scheduler_hooks",
            "tokenwise.engine.scheduler",
            "tokenwise.engine.step_apply",
            "tokenwise.engine.async_scheduler",
            "tokenwise.engine.stop_rules",
            "tokenwise.engine.detokenizer",
            "tokenwise.engine.prompts",
            "tokenwise.engine.stats",
            "tokenwise.engine.step_records",
            "tokenwise.engine.output_processor",
            "tokenwise.engine.drafter",
            "tokenwise.engine.virtual_engines",
            "tokenwise.engine.kinds",
            "tokenwise.engine.kinds.encoder_inputs",
            "tokenwise.engine.kinds.image_inputs",
            "tokenwise.engine.kinds.requests",
            "tokenwise.engine.kinds.audio",
            "tokenwise.engine.kinds.pooling_scheduler",
            "tokenwise.engine.kinds.encoder_decoder_scheduler",
        ),
    ),
    # The TP workers' processes and the per-step channel to them, which carries the runner's
    # step inputs: the runner drives both.
    # Pipeline stages are spawned the same way; their channel carries activations between them.
    Layer(
        "tensor-parallel launch",
        (
            "tokenwise.distributed.tp_launch",
            "tokenwise.distributed.pp_launch",
            "tokenwise.distributed.pp_channel",
        ),
    ),
    # Input batch, model runner, CUDA graphs, KV cache sizing: a scheduled step to sampled
    # tokens. The TP channel sends the runner's step inputs, so it lives beside them.
    Layer(
        "runner",
        (
            "tokenwise.runner.*",
            "tokenwise.distributed.tp_channel",
            "tokenwise.distributed.step_message",
        ),
    ),
    # Executor -> worker -> runner: the executor owns an engine's workers (this process's and
    # the ranks it spawns); a worker owns its device, its groups and one runner; the other
    # ranks' entry point (spawned or torchrun) builds theirs. The engine constructors call it
    # (a torchrun rank other than 0 turns into a worker before any engine).
    Layer("executor", ("tokenwise.executor.*",)),
    # Model kinds as strategies (generate, embed, encoder-decoder): each names its runner and
    # scheduler and supplies prompt processing, KV-cache groups and outputs to the one loop.
    Layer("model kinds", ("tokenwise.engine.kinds.*",)),
    # Pipeline parallelism's loop: P micro-batches in flight over the virtual engines.
    Layer("pipeline loop", ("tokenwise.engine.pipeline_loop",)),
    # The engine loop: the same for every kind.
    Layer(
        "engine loop",
        (
            "tokenwise.engine.sleep_control",
            "tokenwise.engine.async_step",
            "tokenwise.engine.llm_engine",
            "tokenwise.engine.speculative_setup",
        ),
    ),
    # Engines callers drive (`EngineClient`): the in-process engine, and the client of
    # engine-core processes (one, or one per DP rank, some of them on other hosts or Ray
    # actors) with its wire messages; `create_engine` picks one.
    Layer(
        "engine clients",
        (
            "tokenwise.engine.core_messages",
            "tokenwise.engine.remote_control",
            "tokenwise.engine.remote_ranks",
            "tokenwise.engine.core_sockets",
            "tokenwise.engine.core_process",
            "tokenwise.engine.core_processes",
            "tokenwise.engine.remote_core",
            "tokenwise.engine.ray_ranks",
            "tokenwise.engine.headless",
            "tokenwise.engine.core_client",
            "tokenwise.engine.client",
        ),
    ),
    # Beam search over any engine's one-token steps: `LLM.beam_search` and the server drive it.
    Layer("beam search", ("tokenwise.entrypoints.beam_search",)),
    # Score / classify requests (text pairs, probabilities): `LLM.score` and the server share it.
    Layer("scoring", ("tokenwise.entrypoints.scoring",)),
    # The offline `LLM` API: what the benchmarks run.
    # Settings resolved against the model into an `EngineConfig`, with the feature table.
    Layer(
        "engine configuration",
        ("tokenwise.entrypoints.feature_rules", "tokenwise.entrypoints.engine_config"),
    ),
    # `EngineArgs`, where each setting is declared once, and the flags every CLI (and
    # benchmark) generates from it; `create_engine_config` calls the layer below.
    Layer(
        "engine arguments",
        (
            "tokenwise.entrypoints.arg_types",
            "tokenwise.entrypoints.engine_flags",
            "tokenwise.entrypoints.engine_args",
        ),
    ),
    Layer("offline API", ("tokenwise.entrypoints.llm",)),
    # Benchmarks run `LLM`, and the CLI below registers them: they sit between the two.
    Layer("benchmarks", ("tokenwise.benchmarks.*",)),
    Layer("CLI and server", ("tokenwise.entrypoints.*", "tokenwise.ray_serve")),
    # `tokenwise/__init__.py` lazily re-exports `LLM` and friends; nothing imports it back.
    Layer("package facade", ("tokenwise",)),
)

# Import circles that are being removed right now, exempt until then. Every import between the
# two modules of a pair (either way) is skipped. Delete the entry when the circle is gone; the
# check says so once it is.
KNOWN_CYCLES_BEING_REMOVED: dict[frozenset[str], str] = {}


@dataclass
class Report:
    """What `check` found: the modules, their layers, their imports and the problems."""

    layers: Sequence[Layer]
    layer_of: dict[str, int] = field(default_factory=dict)
    edges: list[ImportEdge] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def describe(self, layer: int) -> str:
        return f"layer '{self.layers[layer].name}' (#{layer})"


def _specificity(pattern: str, module: str) -> tuple[int, int] | None:
    """How closely `pattern` names `module` (more specific is larger), None if it does not."""
    if pattern.endswith(".*"):
        base = pattern[:-2]
        if module == base or module.startswith(base + "."):
            return (len(base), 0)
        return None
    return (len(pattern), 1) if module == pattern else None


def layer_index(module: str, layers: Sequence[Layer]) -> int | None:
    """The layer whose most specific pattern matches `module`."""
    best: tuple[tuple[int, int], int] | None = None
    for index, layer in enumerate(layers):
        for pattern in layer.patterns:
            score = _specificity(pattern, module)
            if score is not None and (best is None or score > best[0]):
                best = (score, index)
    return None if best is None else best[1]


def check(
    package_dir: Path = PACKAGE_DIR,
    layers: Sequence[Layer] = LAYERS,
    known_cycles: dict[frozenset[str], str] | None = None,
) -> Report:
    """Check the package at `package_dir` against `layers`; see the module docstring."""
    if known_cycles is None:
        known_cycles = KNOWN_CYCLES_BEING_REMOVED
    report = Report(layers=layers)
    patterns = [p for layer in layers for p in layer.patterns]
    for pattern in sorted({p for p in patterns if patterns.count(p) > 1}):
        report.problems.append(f"pattern {pattern!r} is listed in more than one layer")
    modules = discover_modules(package_dir)
    display_root = package_dir.resolve().parent
    for module, path in modules.items():
        layer = layer_index(module, layers)
        if layer is None:
            shown = path.relative_to(display_root).as_posix()
            report.problems.append(
                f"{shown}: module {module} is in no layer; add it to LAYERS in {THIS_MODULE}"
            )
        else:
            report.layer_of[module] = layer
    report.edges = collect_imports(modules, display_root)

    same_layer: dict[str, set[str]] = {}
    everything: dict[str, set[str]] = {}
    for edge in report.edges:
        if edge.target not in modules:
            report.problems.append(
                f"{edge.where()}: imports {edge.target}, which is no module of the package "
                f"({edge.kind})"
            )
            continue
        everything.setdefault(edge.source, set()).add(edge.target)
        if frozenset({edge.source, edge.target}) in known_cycles:
            continue
        src, dst = report.layer_of.get(edge.source), report.layer_of.get(edge.target)
        if src is None or dst is None:
            continue  # already reported as in no layer
        if dst > src:
            report.problems.append(
                f"{edge.where()}: upward import ({edge.kind}): {edge.source} in "
                f"{report.describe(src)} imports {edge.target} in {report.describe(dst)}"
            )
        elif dst == src:
            same_layer.setdefault(edge.source, set()).add(edge.target)

    for component in strongly_connected(modules, same_layer):
        members = set(component)
        layer = report.layer_of[component[0]]
        lines = [
            f"    {e.where()}: {e.source} imports {e.target} ({e.kind})"
            for e in report.edges
            if e.source in members
            and e.target in members
            and frozenset({e.source, e.target}) not in known_cycles
        ]
        report.problems.append(
            f"import cycle in {report.describe(layer)} among {', '.join(component)}:\n"
            + "\n".join(lines)
        )

    still_cyclic = [set(c) for c in strongly_connected(modules, everything)]
    for pair, why in known_cycles.items():
        if not any(pair <= component for component in still_cyclic):
            names = " <-> ".join(sorted(pair))
            report.notes.append(
                f"known cycle {names} ({why}) is gone: delete its KNOWN_CYCLES_BEING_REMOVED entry"
            )
    return report


def format_report(report: Report) -> str:
    """A human-readable verdict: the problems (or a one-line OK), then any notes."""
    lines: list[str] = []
    if report.ok:
        lines.append(
            f"OK: {len(report.layer_of)} modules in {len(report.layers)} layers, "
            f"{len(report.edges)} imports, no upward import, no import cycle."
        )
    else:
        lines.append(f"{len(report.problems)} layering problem(s):")
        lines += [f"  {problem}" for problem in sorted(report.problems)]
        lines.append("")
        lines.append("Layers, lowest first (a module may import its own layer and lower ones):")
        for i, layer in enumerate(report.layers):
            lines.append(f"  #{i} {layer.name}: {', '.join(layer.patterns)}")
    lines += [f"note: {note}" for note in report.notes]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tokenwise.tools.check_layers",
        description="Check that the package's imports respect its layer order (LAYERS).",
    )
    parser.add_argument(
        "--package-dir",
        type=Path,
        default=PACKAGE_DIR,
        help=f"the package to check (default: {PACKAGE_DIR})",
    )
    parser.add_argument(
        "--list", action="store_true", help="also print every module with its layer"
    )
    args = parser.parse_args(argv)
    if not (args.package_dir / "__init__.py").is_file():
        parser.error(f"{args.package_dir} is not a package (no __init__.py)")
    report = check(args.package_dir)
    if args.list:
        for module, layer in sorted(report.layer_of.items(), key=lambda item: (item[1], item[0])):
            print(f"#{layer:<2} {report.layers[layer].name:<20} {module}")
    print(format_report(report), file=sys.stdout if report.ok else sys.stderr)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
