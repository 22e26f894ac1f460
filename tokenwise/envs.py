"""Every environment variable tokenwise reads, declared once: name, type, default, meaning.

Settings a user chooses per engine are `EngineArgs` fields (`entrypoints/engine_args.py`);
the variables here are for what is not a per-engine choice: switches of the CPU kernels,
bounds on waits, debugging aids, and paths. Modules read them through `get(name)` (the raw
text, or the declared default when unset) and parse them where they are used, so each error
still names the variable and the values it takes. Values are read at call time, never cached
at import, so a test or a launcher may set them late.

`warn_undeclared()` (run when an engine config is created) warns about a `TOKENWISE_*`
variable that is not declared: most likely a typo that would otherwise be ignored silently.
`docs/configuration.md` lists these declarations; `tests/test_envs.py` keeps the two equal.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

logger = logging.getLogger("tokenwise")

PREFIX = "TOKENWISE_"


@dataclass(frozen=True)
class EnvVar:
    """One variable. `default` is the text used when it is unset ("" = the behaviour the doc
    describes); `type` is what the text must parse as, for the docs."""

    name: str
    type: str
    default: str
    doc: str


def _declare(*variables: EnvVar) -> dict[str, EnvVar]:
    return {v.name: v for v in variables}


ENV_VARS: dict[str, EnvVar] = _declare(
    # KV-cache events for cluster routers (`--kv-events-config`).
    EnvVar(
        "TOKENWISE_KV_EVENTS_SECRET",
        "str",
        "",
        "Shared secret that lets KV-cache events be published beyond loopback (CurveZMQ keys "
        "derived from it; subscribers need the same secret).",
    ),
    # The engine's own sockets between hosts (data parallelism across hosts).
    EnvVar(
        "TOKENWISE_CLUSTER_SECRET",
        "str",
        "",
        "Shared secret that lets data-parallel ranks and engine cores talk beyond loopback "
        "(CurveZMQ keys derived from it; every host needs the same value), and that Ray "
        "TP/PP ranks on other hosts prove at their rendezvous. Without it a "
        "--data-parallel-address other than loopback, or such a placement, is refused.",
    ),
    # CPU kernels and weight layout.
    EnvVar("TOKENWISE_CPU_KERNELS", "0|1", "1", "0 turns off the C paged-decode attention kernel."),
    EnvVar(
        "TOKENWISE_CPU_MARCH",
        "str",
        "native",
        "The -march the C kernels are built for: `native` (this CPU), or e.g. `haswell` to build "
        "and measure the AVX2+FMA path on an AVX-512 machine.",
    ),
    EnvVar("TOKENWISE_CPU_GEMV", "bool", "1", "0/false/off/no turns off the C GEMV kernel."),
    EnvVar("TOKENWISE_CPU_FUSED", "bool", "1", "0/false/off/no turns off the fused C kernels."),
    EnvVar(
        "TOKENWISE_CPU_PREPACK",
        "auto|bool",
        "auto",
        "oneDNN prepacking of linear weights: on, off, or auto (on unless it would take more "
        "than a share of the available memory).",
    ),
    EnvVar(
        "TOKENWISE_CPU_HUGE_PAGES",
        "bool",
        "1",
        "0/false/off/no keeps CPU weights off transparent huge pages.",
    ),
    EnvVar(
        "TOKENWISE_CPU_QUANT_ACTIVATIONS",
        "int8|int16",
        "int8",
        "bits bf16 activations are quantized to before the int8/int4 CPU kernels.",
    ),
    EnvVar(
        "TOKENWISE_CPU_QUANT_FP32_ACTIVATIONS",
        "auto|float|int8",
        "auto",
        "float32 activations before the int8/int4 CPU kernels: float keeps the exact product, "
        "int8 quantizes them per 32 values as llama.cpp does for Q8_0/Q4_0 (2.6-3.4x faster "
        "decode GEMV on AVX2 without VNNI); auto: int8 for a GGUF file's layers, float else.",
    ),
    EnvVar(
        "TOKENWISE_CPU_FP8_WEIGHTS",
        "auto|dense|fp8",
        "auto",
        "fp8 checkpoints on CPU: fp8 keeps fp8 bytes (C kernel), dense dequantizes once at "
        "load, auto = fp8 where the C kernel builds.",
    ),
    EnvVar(
        "TOKENWISE_KERNEL_CACHE",
        "path",
        "",
        "where compiled C kernels are cached (default ~/.cache/tokenwise/kernels).",
    ),
    EnvVar(
        "TOKENWISE_ATTENTION_BACKEND",
        "torch|triton",
        "",
        "force an attention backend (default: triton on CUDA with Triton, else torch).",
    ),
    # Engine processes and waits.
    EnvVar(
        "TOKENWISE_ENABLE_MULTIPROCESSING",
        "0|1",
        "1",
        "0 runs the server's engine core in the server process instead of its own.",
    ),
    EnvVar(
        "TOKENWISE_SERVER_NICE",
        "int 0-19",
        "0",
        "How many nice levels `tokenwise serve`'s API process lowers its own priority once its "
        "engine-core processes run, so its per-token HTTP work does not preempt their forward "
        "pass's OpenMP threads (docs/performance.md); 0 (default: it cost 6% on a quiet machine) leaves it as started.",
    ),
    EnvVar(
        "TOKENWISE_SERVER_DEV_MODE",
        "0|1",
        "0",
        "1 opens the server's control routes (vLLM's VLLM_SERVER_DEV_MODE): /sleep, /wake_up, "
        "/is_sleeping, /pause, /resume, /is_paused, /update_weights, "
        "/init_weight_transfer_engine. Only for trusted networks.",
    ),
    EnvVar(
        "TOKENWISE_ENGINE_READY_TIMEOUT_S",
        "float",
        "",
        "seconds start-up waits for every engine rank (default 600).",
    ),
    EnvVar(
        "TOKENWISE_WORKER_START_TIMEOUT_S",
        "float",
        "",
        "seconds a spawned worker may take to reach the rendezvous (default in "
        "distributed/rendezvous.py).",
    ),
    EnvVar(
        "TOKENWISE_STEP_RECORDS",
        "int",
        "2048",
        "engine steps kept in the step-record ring buffer.",
    ),
    EnvVar(
        "TOKENWISE_LOG_BATCHSIZE_INTERVAL",
        "float",
        "-1",
        "seconds between batch-size forward-time tables in the log; < 0 off (serve: 60).",
    ),
    EnvVar(
        "TOKENWISE_GRAMMAR_COMPILE_TIMEOUT_S",
        "float",
        "",
        "seconds a guided-decoding grammar may take to compile (default 30).",
    ),
    EnvVar(
        "TOKENWISE_PLUGINS",
        "comma list",
        "",
        "modules imported in every engine process; they register out-of-tree models.",
    ),
    # Parallelism.
    EnvVar(
        "TOKENWISE_PP_LAYER_PARTITION",
        "comma list",
        "",
        "layers per pipeline stage, e.g. '4,4' (default: even, extra layers late).",
    ),
    EnvVar(
        "TOKENWISE_MOE_DP_CHUNK_SIZE",
        "int",
        "",
        "tokens per rank per MoE exchange under data parallelism (default 256).",
    ),
    EnvVar(
        "TOKENWISE_DBO_SEQUENTIAL",
        "0|1",
        "0",
        "1 runs micro-batches one after the other (no overlap), for comparison.",
    ),
    EnvVar(
        "TOKENWISE_DBO_TIMEOUT_S",
        "float",
        "",
        "bound on every dual-batch-overlap wait (default 300).",
    ),
    EnvVar(
        "TOKENWISE_MOE_COLLECTIVE_DELAY_MS",
        "float",
        "",
        "latency added to each MoE collective, a benchmark's stand-in for a slow link (default 0).",
    ),
    # Server.
    EnvVar("TOKENWISE_API_KEY", "str", "", "default of `serve --api-key`."),
    EnvVar(
        "TOKENWISE_IMAGE_FETCH_TIMEOUT",
        "float",
        "",
        "seconds an image URL download may take (default 5).",
    ),
    EnvVar(
        "TOKENWISE_IMAGE_FETCH_MAX_MB",
        "float",
        "",
        "largest image download in MB (default 20).",
    ),
    EnvVar(
        "TOKENWISE_MEDIA_URL_ALLOW_REDIRECTS",
        "0|1",
        "1",
        "0 refuses redirects when fetching image URLs.",
    ),
    EnvVar(
        "TOKENWISE_GGUF_CACHE",
        "path",
        "",
        "where tokenizers converted from GGUF files are cached (default "
        "$XDG_CACHE_HOME/tokenwise/gguf-tokenizers).",
    ),
    # The test suite's own knobs (tests/entrypoints/test_fuzz.py), declared so that setting
    # them draws no warning.
    EnvVar("TOKENWISE_FUZZ_SEED", "int", "1234", "test suite: seed of the API fuzz test."),
    EnvVar("TOKENWISE_FUZZ_EXAMPLES", "int", "70", "test suite: fuzz cases per generation route."),
)

# Variables of other programs that tokenwise reads (never declares or documents as its own).
EXTERNAL = (
    "CC",
    "XDG_CACHE_HOME",
    "OMP_NUM_THREADS",
    "RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "TORCHELASTIC_RUN_ID",
    "PYTHONPATH",  # handed to Ray actors with the TOKENWISE_* variables
)


def get(name: str) -> str:
    """The text of declared variable `name`, or its declared default when unset."""
    if name not in ENV_VARS:
        raise KeyError(f"{name} is not declared in tokenwise/envs.py")
    return os.environ.get(name, ENV_VARS[name].default)


def external(name: str) -> str | None:
    """Another program's variable (`EXTERNAL`: torchrun's RANK, the compiler's CC, ...)."""
    if name not in EXTERNAL:
        raise KeyError(f"{name} is not listed in tokenwise.envs.EXTERNAL")
    return os.environ.get(name)


def tokenwise_variables() -> dict[str, str]:
    """The `TOKENWISE_*` variables set in this process, for workers started elsewhere (Ray
    actors), which do not inherit this process's environment."""
    return {name: value for name, value in os.environ.items() if name.startswith(PREFIX)}


def set_default(name: str, value: str) -> None:
    """Set a variable for this process and its children unless the user set it."""
    os.environ.setdefault(name, value)


_warned: set[str] = set()


def warn_undeclared() -> list[str]:
    """Warn (once per name and process) about set `TOKENWISE_*` variables that are not
    declared; returns the names warned about now."""
    unknown = sorted(
        name
        for name in os.environ
        if name.startswith(PREFIX) and name not in ENV_VARS and name not in _warned
    )
    for name in unknown:
        _warned.add(name)
        logger.warning(
            "environment variable %s is not a tokenwise setting and is ignored (the "
            "variables are listed in docs/configuration.md)",
            name,
        )
    return unknown
