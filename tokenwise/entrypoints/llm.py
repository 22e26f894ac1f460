"""The offline API, as in vLLM: `LLM(model).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from tokenwise.config import (
    SPEC_MODEL_METHODS,
    CacheConfig,
    CompilationConfig,
    CUDAGraphMode,
    EngineConfig,
    LoRAConfig,
    ParallelConfig,
    PoolerConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from tokenwise.engine.client import create_engine
from tokenwise.engine.kinds.multimodal_settings import (
    check_multimodal_settings,
    parse_limit_mm_per_prompt,
)
from tokenwise.engine.prompts import PromptInput, resolve_eos_token_ids, validate_request
from tokenwise.entrypoints.beam_search import (
    BeamSearch,
    BeamSearchOutput,
    BeamSearchParams,
    run_beam_search,
    top_logprobs,
)
from tokenwise.layers.fused_moe.experts import grouped_mm_available
from tokenwise.layers.quantization import cpu_qgemv
from tokenwise.lora.request import LoRARequest
from tokenwise.model_config import ModelConfig
from tokenwise.models.registry import (
    is_encoder_decoder_architecture,
    is_moe_architecture,
    is_multimodal_architecture,
)
from tokenwise.outputs import EmbeddingRequestOutput, RequestOutput
from tokenwise.pooling.params import PoolingParams
from tokenwise.pooling.task import check_embed_settings, resolve_pooler_config, resolve_task
from tokenwise.quantization_config import uses_cpu_kernels
from tokenwise.sampling.params import SamplingParams

logger = logging.getLogger("tokenwise")


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_cudagraph_mode(
    cudagraph_mode: str | CUDAGraphMode | None,
    device: str,
    enforce_eager: bool,
    moe_needs_host: bool = False,
) -> CUDAGraphMode:
    """The CUDA-graph mode: as asked (checked against device and eagerness), or the default.

    Default: NONE on CPU and with enforce_eager; on CUDA, FULL_AND_PIECEWISE (whole decode steps
    and compiled pieces of mixed steps are replayed) when the attention backend's decode can be
    captured, else PIECEWISE. MoE models whose expert op reads per-expert token counts on the
    host (`moe_needs_host`: no grouped matmul for the device and dtype) get PIECEWISE at most,
    since no captured graph can hold a host read; the graph is cut there like at attention.
    """
    if cudagraph_mode is None:
        if enforce_eager or not device.startswith("cuda"):
            return CUDAGraphMode.NONE
        if moe_needs_host:
            return CUDAGraphMode.PIECEWISE
        from tokenwise.attention.backends.selector import BACKENDS, backend_name_for

        backend = BACKENDS[backend_name_for(device)]
        if getattr(backend, "supports_full_cudagraph", False):
            return CUDAGraphMode.FULL_AND_PIECEWISE
        return CUDAGraphMode.PIECEWISE
    mode = CUDAGraphMode.parse(cudagraph_mode)
    if mode == CUDAGraphMode.NONE:
        return mode
    if moe_needs_host and mode.has_full_cudagraphs():
        raise ValueError(
            f"cudagraph_mode={mode.name} captures whole forward passes, which this MoE model's "
            "expert layers cannot be part of (without a grouped matmul for this GPU and dtype, "
            "their token counts per expert are read on the host; bf16 on sm90+ has one); use "
            "cudagraph_mode=PIECEWISE"
        )
    if not device.startswith("cuda"):
        raise ValueError(
            f"cudagraph_mode={mode.name} needs a CUDA device, but device is {device!r}; "
            "use cudagraph_mode=NONE"
        )
    if enforce_eager:
        raise ValueError(
            f"cudagraph_mode={mode.name} cannot be combined with enforce_eager=True (eager "
            "means no compilation and no CUDA graphs); drop one of them"
        )
    return mode


def build_engine_config(
    model: str | None = None,
    dtype: str | torch.dtype = "auto",
    seed: int = 0,
    max_model_len: int | None = None,
    max_num_seqs: int = 128,
    max_num_batched_tokens: int = 2048,
    block_size: int = 16,
    kv_cache_memory: int | None = None,
    num_gpu_blocks: int | None = None,
    load_format: str = "auto",
    enforce_eager: bool | None = None,
    skip_tokenizer_init: bool = False,
    enable_prefix_caching: bool = True,
    enable_chunked_prefill: bool = True,
    gpu_memory_utilization: float = 0.9,
    tokenizer: str | None = None,
    device: str | None = None,
    cudagraph_mode: str | CUDAGraphMode | None = None,
    cudagraph_capture_sizes: list[int] | None = None,
    data_parallel_size: int = 1,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    data_parallel_address: str | None = None,
    data_parallel_port: int | None = None,
    data_parallel_size_local: int | None = None,
    data_parallel_start_rank: int = 0,
    data_parallel_rpc_port: int = 29550,
    enable_expert_parallel: bool = False,
    enable_microbatching: bool = False,
    microbatching_token_threshold: int | None = None,
    enable_dbo: bool = False,
    dbo_decode_token_threshold: int | None = None,
    dbo_prefill_token_threshold: int | None = None,
    enable_lora: bool = False,
    max_loras: int = 1,
    max_lora_rank: int = 16,
    max_cpu_loras: int | None = None,
    task: str = "generate",
    override_pooler_config: PoolerConfig | None = None,
    disable_log_requests: bool = True,
    speculative_config: dict[str, Any] | SpeculativeConfig | None = None,
    quantization: str | None = None,
    scheduling_policy: str = "fcfs",
    limit_mm_per_prompt: dict[str, int] | None = None,
    max_num_encoder_input_tokens: int | None = None,
) -> EngineConfig:
    """One place that turns user-facing arguments (LLM, CLI, server) into an EngineConfig."""
    from tokenwise.default_model import resolve_model_path

    device = device or default_device()
    if enforce_eager is None:
        # On CPU compiling costs 15+ s and gained only 3-16% in decode (PERF_NOTES), so eager
        # is the default there; on GPU compilation is what makes the small kernels cheap.
        enforce_eager = not device.startswith("cuda")
    model_config = ModelConfig.from_pretrained(
        resolve_model_path(model),
        dtype=dtype,
        max_model_len=max_model_len,
        device=device,
        seed=seed,
        load_format=load_format,
        tokenizer=tokenizer,
        skip_tokenizer_init=skip_tokenizer_init,
        quantization=quantization,
    )
    if uses_cpu_kernels(model_config.quantization, device):
        if not enforce_eager:
            raise ValueError(
                f"quantization={model_config.quantization!r} runs its CPU kernels eagerly "
                "(torch.compile does not trace them): leave enforce_eager at its default or True"
            )
        cpu_qgemv.activation_bits()  # a bad TOKENWISE_CPU_QUANT_ACTIVATIONS fails here
    model_config.task = resolve_task(task, model_config.architectures)
    if model_config.is_pooling:
        model_config.pooler_config = resolve_pooler_config(
            model_config.model, model_config.architectures, override_pooler_config
        )
        check_embed_settings(data_parallel_size, tensor_parallel_size, cudagraph_mode)
        enforce_eager, cudagraph_mode = True, None  # see tokenwise.engine.kinds.pooling_runner
    elif override_pooler_config is not None:
        raise ValueError("override_pooler_config applies to task='embed' models only")
    if is_encoder_decoder_architecture(model_config.architectures):
        check_encoder_decoder_settings(data_parallel_size, tensor_parallel_size)
        if cudagraph_mode is None or CUDAGraphMode.parse(cudagraph_mode) == CUDAGraphMode.NONE:
            # Compiled and graphed only when a graph mode is asked for: that path is tested on
            # CPU with capture faked, not yet on a GPU (tokenwise.engine.kinds.encoder_decoder_runner).
            enforce_eager = True
    if is_multimodal_architecture(model_config.architectures):
        check_multimodal_settings(
            model_config, limit_mm_per_prompt, data_parallel_size, tensor_parallel_size
        )
        enforce_eager, cudagraph_mode = True, None  # see engine/kinds/multimodal_runner.py
    else:  # a text-only model refuses every image, whatever the limit says
        model_config.limit_mm_per_prompt = parse_limit_mm_per_prompt(limit_mm_per_prompt)
    speculative = None
    if speculative_config is not None:
        speculative = SpeculativeConfig.from_dict(speculative_config)
        archs = model_config.architectures
        if (
            model_config.is_pooling
            or is_encoder_decoder_architecture(archs)
            or is_multimodal_architecture(archs)
        ):
            raise ValueError(
                "speculative_config applies to text-only decoder generation models, not to "
                f"{', '.join(model_config.architectures)}"
            )
        if speculative.method in SPEC_MODEL_METHODS and tensor_parallel_size > 1:
            # The draft (or EAGLE / MTP head) runs on the driver alone, unsharded; its layers
            # would read the TP rank.
            raise ValueError(
                f"speculative_config.method {speculative.method!r}: its draft model does not run "
                f"under tensor_parallel_size={tensor_parallel_size} yet (use data parallelism, "
                "where each rank runs its own draft, or method 'ngram')"
            )
    is_moe = is_moe_architecture(model_config.architectures)
    collectives = (data_parallel_size > 1 and is_moe) or tensor_parallel_size > 1
    collectives = collectives or pipeline_parallel_size > 1
    if collectives and not enforce_eager:
        # Layers that talk to other ranks run eagerly for now: captured collectives are
        # not verified yet (no GPU was at hand when this was built).
        logger.info("tensor or pipeline parallelism, or DP with MoE, runs eagerly (no graphs)")
        enforce_eager, cudagraph_mode = True, None
    hf = model_config.hf_config
    moe_needs_host = False
    if is_moe:
        moe_size = getattr(hf, "moe_intermediate_size", 0) or hf.intermediate_size
        moe_needs_host = not grouped_mm_available(
            device, model_config.dtype, (hf.hidden_size, moe_size)
        )
    mode = resolve_cudagraph_mode(cudagraph_mode, device, enforce_eager, moe_needs_host)
    parallel = ParallelConfig(
        data_parallel_size=data_parallel_size,
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
        is_moe_model=is_moe,
        enable_expert_parallel=enable_expert_parallel,
        # vLLM's name for the same switch (dual-batch overlap).
        enable_microbatching=enable_microbatching or enable_dbo,
        data_parallel_master_ip=data_parallel_address or "127.0.0.1",
        data_parallel_master_port=data_parallel_port,
        data_parallel_size_local=data_parallel_size_local,
        data_parallel_start_rank=data_parallel_start_rank,
        data_parallel_rpc_port=data_parallel_rpc_port,
    )
    if microbatching_token_threshold is not None:
        parallel.microbatching_decode_token_threshold = microbatching_token_threshold
        parallel.microbatching_prefill_token_threshold = microbatching_token_threshold
    for name, value in (
        ("dbo_decode_token_threshold", dbo_decode_token_threshold),
        ("dbo_prefill_token_threshold", dbo_prefill_token_threshold),
    ):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if dbo_decode_token_threshold is not None:
        parallel.microbatching_decode_token_threshold = dbo_decode_token_threshold
    if dbo_prefill_token_threshold is not None:
        parallel.microbatching_prefill_token_threshold = dbo_prefill_token_threshold
    return EngineConfig(
        model=model_config,
        cache=CacheConfig(
            block_size=block_size,
            kv_cache_memory=kv_cache_memory,
            num_gpu_blocks=num_gpu_blocks,
            enable_prefix_caching=enable_prefix_caching,
            gpu_memory_utilization=gpu_memory_utilization,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=enable_chunked_prefill,
            policy=scheduling_policy,
            max_num_encoder_input_tokens=max_num_encoder_input_tokens,
        ),
        compilation=CompilationConfig(
            use_compile=not enforce_eager,
            cudagraph_mode=mode,
            cudagraph_capture_sizes=cudagraph_capture_sizes,
        ),
        parallel=parallel,
        device=device,
        lora=LoRAConfig(max_loras, max_lora_rank, max_cpu_loras) if enable_lora else None,
        log_requests=not disable_log_requests,
        speculative=speculative,
    )


def check_encoder_decoder_settings(data_parallel_size: int, tensor_parallel_size: int) -> None:
    """Encoder-decoder models run on one rank for now: refuse what would not apply."""
    if data_parallel_size != 1 or tensor_parallel_size != 1:
        raise ValueError(
            "encoder-decoder models (BART, Whisper) run on one rank: data_parallel_size and "
            f"tensor_parallel_size must be 1, got {data_parallel_size} and {tensor_parallel_size}"
        )


class LLM:
    """Generate completions for a batch of prompts with continuous batching.

    `model` is a local Hugging Face checkpoint directory; None means the built-in model.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self._start(build_engine_config(model, **kwargs))

    @classmethod
    def from_engine_config(cls, config: EngineConfig) -> LLM:
        """An LLM over a ready `EngineConfig` (for settings the keyword arguments lack)."""
        llm = cls.__new__(cls)
        llm._start(config)
        return llm

    def _start(self, config: EngineConfig) -> None:
        self.engine_config = config
        torch.manual_seed(config.model.seed)
        self.llm_engine = create_engine(config)
        self._counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def shutdown(self) -> None:
        """Stop the engine's rank processes (data parallelism); a no-op for one engine."""
        stop = getattr(self.llm_engine, "shutdown", None)
        if stop is not None:
            stop()

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in the order of `prompts`. A single prompt may be passed without a list.

        `lora_request` is one adapter for every prompt or one per prompt (None: base model).
        `priority` is one integer per prompt (lower is served first), for an engine built with
        `scheduling_policy="priority"`.
        """
        if self.engine_config.model.is_pooling:
            raise ValueError(
                f"model {self.engine_config.model.model!r} was loaded with task='embed' and "
                "cannot generate text; call LLM.embed(prompts)"
            )
        prompts = _as_prompt_list(prompts)
        if sampling_params is None:
            params_list = [SamplingParams()] * len(prompts)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} sampling_params for {len(prompts)} prompts; pass "
                    "one SamplingParams or one per prompt"
                )
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(
                    f"got {len(loras)} lora_requests for {len(prompts)} prompts; pass one "
                    "LoRARequest or one per prompt"
                )
        if priority is not None:
            priority = list(priority)
            if len(priority) != len(prompts):
                raise ValueError(
                    f"got {len(priority)} priority values for {len(prompts)} prompts; pass one "
                    "per prompt"
                )
        return self._run(self._add_all(prompts, params_list, loras, priority), use_tqdm)

    def beam_search(
        self, prompts: PromptInput | Sequence[PromptInput], params: BeamSearchParams
    ) -> list[BeamSearchOutput]:
        """The `params.beam_width` best beams of each prompt, best first, as vLLM's
        `LLM.beam_search`; equal to Hugging Face's `generate(num_beams=beam_width,
        num_return_sequences=beam_width, do_sample=False)` (`entrypoints/beam_search.py`).

        Each step runs every live beam of every prompt as one batch of one-token requests.
        """
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        model = self.engine_config.model
        if model.is_pooling:
            raise ValueError("beam search needs a generative model, not task='embed'")
        tokenizer = self.get_tokenizer()
        eos = resolve_eos_token_ids(model, tokenizer)
        searches = []
        for prompt in _as_prompt_list(prompts):
            if isinstance(prompt, dict) and prompt.get("multi_modal_data"):
                # Each beam step sends token ids, which would leave the images behind.
                raise ValueError("beam search takes text prompts only, not multi_modal_data")
            _, token_ids = validate_request(model, tokenizer, prompt, SamplingParams())
            if len(token_ids) + params.max_tokens > model.max_model_len:
                raise ValueError(
                    f"max_tokens={params.max_tokens} with a prompt of {len(token_ids)} tokens "
                    f"exceeds max_model_len={model.max_model_len}"
                )
            searches.append(BeamSearch(token_ids, params, eos))

        def step(beams: list[list[int]], k: int) -> list[dict[int, float]]:
            one_token = SamplingParams(temperature=0.0, max_tokens=1, logprobs=k, ignore_eos=True)
            inputs: list[PromptInput] = [{"prompt_token_ids": beam} for beam in beams]
            outs = self._run(self._add_all(inputs, [one_token] * len(beams)), use_tqdm=False)
            return [top_logprobs((o.outputs[0].logprobs or [None])[0], k) for o in outs]

        run_beam_search(searches, step)
        decode = None if tokenizer is None else tokenizer.decode
        return [search.result(decode) for search in searches]

    def embed(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in the order of `prompts` (strings, token-id lists or
        `{"prompt_token_ids": [...]}`), batched by the scheduler like generation.

        Needs a model loaded with `task="embed"` (or "auto" on an encoder-only checkpoint).
        A request whose forward pass failed comes back with `error` set.
        """
        if not self.engine_config.model.is_pooling:
            raise ValueError(
                f"model {self.engine_config.model.model!r} was loaded with "
                f"task={self.engine_config.model.task!r}; LLM.embed needs an embedding model: "
                "load an encoder-only checkpoint (BERT, XLM-RoBERTa) with task='embed'"
            )
        prompts = _as_prompt_list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params_list = [pooling_params or PoolingParams()] * len(prompts)
        else:
            params_list = list(pooling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} pooling_params for {len(prompts)} prompts; pass "
                    "one PoolingParams or one per prompt"
                )
        return self._run(self._add_all(prompts, params_list), use_tqdm, "Embedding")

    def _add_all(
        self,
        prompts: list[PromptInput],
        params_list: list[Any],
        loras: list[LoRARequest | None] | None = None,
        priorities: list[int] | None = None,
    ) -> list[str]:
        """Add every prompt, or none: a bad one aborts those already added, then raises."""
        engine = self.llm_engine
        ids: list[str] = []
        loras = loras or [None] * len(prompts)
        priorities = priorities or [0] * len(prompts)
        try:
            for prompt, params, lora, priority in zip(
                prompts, params_list, loras, priorities, strict=True
            ):
                rid = str(next(self._counter))
                kwargs: dict[str, Any] = {}
                if lora is not None:
                    kwargs["lora_request"] = lora
                if priority != 0:  # the default: any engine takes it
                    kwargs["priority"] = priority
                engine.add_request(rid, prompt, params, **kwargs)
                ids.append(rid)
        except Exception:
            engine.abort_request(ids)
            self._drain(set(ids))
            raise
        return ids

    def _run(self, ids: list[str], use_tqdm: bool, desc: str = "Generating") -> list[Any]:
        engine = self.llm_engine
        pending = set(ids)
        results: dict[str, Any] = {}
        bar = tqdm(total=len(ids), desc=desc, disable=not use_tqdm)
        try:
            while pending:
                for delta in engine.step():
                    if delta.request_id not in pending:
                        continue
                    if delta.request_id in results:
                        results[delta.request_id].merge(delta)
                    else:
                        results[delta.request_id] = delta
                    if delta.finished:
                        pending.discard(delta.request_id)
                        bar.update(1)
        except BaseException:
            engine.abort_request(list(pending))
            self._drain(pending)
            raise
        finally:
            bar.close()
        return [results[rid] for rid in ids]

    def _drain(self, ids: set[str]) -> None:
        """Step until aborted requests have been reported, so no block stays allocated."""
        while any(self.llm_engine.has_request(rid) for rid in ids):
            self.llm_engine.step()


def _as_prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    """A single prompt (a string, a dict or one token-id list) becomes a list of one."""
    if isinstance(prompts, (str, dict)) or (
        isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)
    ):
        return [prompts]  # type: ignore[list-item]
    return list(prompts)  # type: ignore[arg-type]
