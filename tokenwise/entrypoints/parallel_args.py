"""The parallelism settings of `EngineArgs`: how many ranks of each kind, how they are started
and found, and how a step is split over micro-batches.

Declared here and inherited by `EngineArgs` (`engine_args.py`), which stays the one class a
setting belongs to: the fields are its fields, their flags its flags. Apart only to keep each
declaration file short enough to read.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenwise.entrypoints.arg_types import bounded_int, positive_int
from tokenwise.entrypoints.engine_flags import setting

PARALLEL = "parallelism (one process per rank)"


@dataclass
class ParallelArgs:
    """Tensor, pipeline, data and expert parallelism, and dual-batch overlap (vLLM's names)."""

    tensor_parallel_size: int = setting(
        1,
        "split each layer over this many processes; with torchrun, the number of "
        "processes torchrun starts (default: 1)",
        flags=("--tensor-parallel-size", "-tp"),
        type=bounded_int(1),
        group=PARALLEL,
    )
    pipeline_parallel_size: int = setting(
        1,
        "split the layers into this many stages, one process each, with as many batches "
        "in flight (Llama, Mistral, Qwen2/3, their MoEs, Gemma 2/3/4, DeepSeek-V2/V3, "
        "gpt-oss; TOKENWISE_PP_LAYER_PARTITION='4,4' sets the split; default: 1)",
        flags=("--pipeline-parallel-size", "-pp"),
        type=bounded_int(1),
        group=PARALLEL,
    )
    distributed_executor_backend: str = setting(
        "mp",
        "how the other tensor/pipeline-parallel ranks start: 'mp' spawned processes, 'ray' "
        "Ray actors on the cluster's nodes (RAY_ADDRESS or a local Ray; pip install "
        "'tokenwise[ray]'); "
        "default: mp",
        choices=["mp", "ray"],
        group=PARALLEL,
    )
    ray_placement_strategy: str = setting(
        "PACK",
        "with --distributed-executor-backend ray: how the placement group spreads one bundle "
        "per rank over the nodes, as Ray's strategies: PACK (as few nodes as have room), "
        "SPREAD (over as many nodes as possible), STRICT_PACK (one node), STRICT_SPREAD (one "
        "rank per node); default: PACK",
        choices=["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"],
        group=PARALLEL,
    )
    data_parallel_size: int = setting(
        1,
        "number of engine ranks; requests go to the least loaded (default: 1)",
        flags=("--data-parallel-size", "-dp"),
        type=bounded_int(1),
        group=PARALLEL,
    )
    data_parallel_backend: str = setting(
        "mp",
        "how the data-parallel ranks' engine cores start: 'mp' processes on this host (and "
        "--headless hosts), 'ray' every rank a Ray actor placed by a placement group over "
        "the cluster's nodes (RAY_ADDRESS or a local Ray; needs --data-parallel-size >= 2, "
        "pip install 'tokenwise[ray]'); default: mp",
        choices=["mp", "ray"],
        group=PARALLEL,
    )
    data_parallel_size_local: int | None = setting(
        None,
        "data-parallel ranks on this host, for ranks on several hosts (default: every "
        "rank from --data-parallel-start-rank on, i.e. all of them on one host)",
        type=bounded_int(1),
        group=PARALLEL,
    )
    data_parallel_start_rank: int = setting(
        0,
        "global rank of this host's first data-parallel rank: 0 on the front end's host, "
        "the first rank it runs on a --headless host (default: 0)",
        type=bounded_int(0),
        group=PARALLEL,
    )
    data_parallel_address: str | None = setting(
        None,
        "address of the first host, where the front end runs: the ranks rendezvous "
        "there (torch.distributed TCP store) and other hosts' ranks connect to it "
        "(default 127.0.0.1; required with --headless)",
        group=PARALLEL,
    )
    data_parallel_rpc_port: int = setting(
        29550,
        "port of the front end that the ranks of other hosts connect to (default 29550)",
        type=bounded_int(1, 65535),
        group=PARALLEL,
    )
    data_parallel_port: int | None = setting(
        None,
        "rendezvous port on the first host (default: a free port, which the front end "
        "tells the other hosts' ranks)",
        type=bounded_int(1, 65535),
        group=PARALLEL,
    )
    enable_expert_parallel: bool = setting(
        False,
        "MoE under DP: each rank holds whole experts instead of a slice of every expert",
        group=PARALLEL,
    )
    enable_microbatching: bool = setting(
        False,
        "MoE under DP: run large steps as two micro-batches whose MoE exchanges overlap "
        "each other's compute (dual-batch overlap; --enable-dbo is vLLM's name)",
        flags=("--enable-microbatching", "--enable-dbo"),
        group=PARALLEL,
    )
    enable_dbo: bool = setting(
        False,
        "vLLM's name for --enable-microbatching",
        group=PARALLEL,
        alias_of="enable_microbatching",
    )
    microbatching_token_threshold: int | None = setting(
        None,
        "with micro-batching: steps with fewer tokens than this are not split, decode and "
        "prefill alike (default: 32 for decode, 512 for prefill)",
        type=positive_int,
        group=PARALLEL,
    )
    dbo_decode_token_threshold: int | None = setting(
        None,
        "with micro-batching: decode steps with fewer tokens are not split (default: 32)",
        type=positive_int,
        group=PARALLEL,
    )
    dbo_prefill_token_threshold: int | None = setting(
        None,
        "with micro-batching: steps with prefills and fewer tokens are not split (default: 512)",
        type=positive_int,
        group=PARALLEL,
    )
