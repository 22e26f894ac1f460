"""The offline API, as in vLLM: `LLM(model).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from tokenwise.config import EngineConfig
from tokenwise.engine.client import create_engine
from tokenwise.engine.prompts import (
    PromptInput,
    as_prompt_list,
    resolve_eos_token_ids,
    validate_request,
)
from tokenwise.entrypoints.beam_search import (
    BeamSearch,
    BeamSearchOutput,
    BeamSearchParams,
    run_beam_search,
    top_logprobs,
)
from tokenwise.entrypoints.engine_args import (  # noqa: F401 (re-exported: the offline API's home)
    EngineArgs,
    build_engine_config,
)
from tokenwise.entrypoints.engine_config import (  # noqa: F401 (re-exported)
    default_device,
    resolve_cudagraph_mode,
)
from tokenwise.entrypoints.scoring import (
    check_task,
    cosine_score,
    distinct_texts,
    pair_prompt,
    score_pairs,
    to_classification,
    to_score,
)
from tokenwise.lora.request import LoRARequest
from tokenwise.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringRequestOutput,
)
from tokenwise.pooling.params import PoolingParams
from tokenwise.sampling.params import SamplingParams

logger = logging.getLogger("tokenwise")


class LLM:
    """Generate completions for a batch of prompts with continuous batching.

    `model` is a local Hugging Face checkpoint directory; None means the built-in model.
    The keyword arguments are `EngineArgs`' fields (vLLM's names), with the same defaults.
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
        # `del llm` (or dropping the last reference) stops the engine's workers and leaves
        # its process groups at once: the engine itself sits in reference cycles, which only
        # the cyclic collector would free, and the next engine of this process needs them gone.
        stop = getattr(self.llm_engine, "shutdown", None)
        self._finalizer = weakref.finalize(self, stop) if stop is not None else None

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def shutdown(self) -> None:
        """Stop the engine: its TP / PP workers or data-parallel rank processes, and its
        process groups. Idempotent; dropping the `LLM` does the same."""
        if self._finalizer is not None:
            self._finalizer()

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        """Run `method` on every worker of the engine (every TP rank); results in rank order.

        `method` is a worker method's name or a module-level function called as
        `method(worker, *args, **kwargs)`, where `worker.runner.model` is that rank's shard.
        """
        rpc = getattr(self.llm_engine, "collective_rpc", None)
        if rpc is None:
            raise NotImplementedError(
                "collective_rpc reaches the workers of an engine in this process; with "
                "data_parallel_size > 1 the ranks run in engine-core processes, which it does "
                "not reach yet"
            )
        return rpc(method, args, kwargs, timeout)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing done) while requests hold KV blocks."""
        reset = getattr(self.llm_engine, "reset_prefix_cache", None)
        if reset is None:
            raise NotImplementedError(
                "reset_prefix_cache reaches an engine in this process; with "
                "data_parallel_size > 1 the ranks run in engine-core processes"
            )
        return reset()

    def _sleep_control(self) -> Any:
        control = getattr(self.llm_engine, "sleep_control", None)
        if control is None:
            raise NotImplementedError(
                "sleep mode and weight updates reach an engine in this process; with "
                "data_parallel_size > 1 the ranks run in engine-core processes"
            )
        return control

    def sleep(self, level: int = 1) -> None:
        """Free the engine's memory until `wake_up` (needs `enable_sleep_mode=True` and no
        running request): level 1 saves the weights to a temporary file and hands their
        memory and the KV cache's back; level 2 discards the weights (load new ones with
        `reload_weights` or a trainer's transfer after waking). Generating while asleep
        raises `EngineAsleepError`."""
        self._sleep_control().sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake the parts `tags` names ("weights", "kv_cache"; None: both)."""
        self._sleep_control().wake_up(tags)

    def is_sleeping(self) -> bool:
        return self._sleep_control().is_sleeping()

    def reload_weights(self, path: str | None = None) -> None:
        """Load a safetensors checkpoint directory (default: the model's own) into the
        running engine in place; the prefix cache is reset and `weight_version` counts up."""
        self.collective_rpc("reload_weights", args=(path,))

    def init_weight_update_group(
        self, host: str, port: int, world_size: int, timeout_s: float = 120.0
    ) -> None:
        """Join a trainer's process group (`tokenwise.distributed.weight_transfer`): the
        trainer is rank 0, this engine's TP ranks 1..world_size-1. Blocks until all joined."""
        self.collective_rpc("init_weight_update_group", args=(host, port, world_size, timeout_s))

    def receive_weights(self) -> int:
        """Receive the trainer's next `WeightSender.send` into the weights (every TP rank keeps
        its shard); returns the number of tensors received."""
        return self.collective_rpc("receive_weights")[0]

    @property
    def weight_version(self) -> int:
        """0 as loaded, one more per weight update; outputs carry the one that made them."""
        return self._sleep_control().weight_version

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
                f"model {self.engine_config.model.model!r} was loaded with "
                f"task={self.engine_config.model.task!r} and cannot generate text; call "
                f"LLM.{_POOLING_CALLS[self.engine_config.model.task]}"
            )
        prompts = as_prompt_list(prompts)
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
            raise ValueError(f"beam search needs a generative model, not task={model.task!r}")
        tokenizer = self.get_tokenizer()
        eos = resolve_eos_token_ids(model, tokenizer)
        searches = []
        for prompt in as_prompt_list(prompts):
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
        if self.engine_config.model.task != "embed":
            raise ValueError(
                f"model {self.engine_config.model.model!r} was loaded with "
                f"task={self.engine_config.model.task!r}; LLM.embed needs an embedding model: "
                "load an encoder-only checkpoint (BERT, XLM-RoBERTa) with task='embed'"
            )
        prompts = as_prompt_list(prompts)
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

    def score(
        self,
        text_1: str | Sequence[str],
        text_2: str | Sequence[str],
        use_tqdm: bool = True,
    ) -> list[ScoringRequestOutput]:
        """The relevance of each text pair, as vLLM's `LLM.score`: `text_1` one text against
        every text of `text_2` (1:1, 1:N), or two lists of the same length paired in order
        (N:N). A cross-encoder (task="score") reads each pair as one sequence, so the scores
        equal the checkpoint's HF model; an embedding model (task="embed") scores a pair by
        the cosine similarity of the two texts' embeddings."""
        model = self.engine_config.model
        check_task(model, ("score", "embed"), "LLM.score")
        pairs = score_pairs(text_1, text_2)
        if model.task == "embed":
            texts, index = distinct_texts(pairs)
            embedded = self._run(
                self._add_all(list(texts), [PoolingParams()] * len(texts)), use_tqdm
            )
            return [
                cosine_score(str(n), embedded[i], embedded[j]) for n, (i, j) in enumerate(index)
            ]
        tokenizer = self.get_tokenizer()
        prompts: list[PromptInput] = [
            pair_prompt(tokenizer, model.hf_config, a, b) for a, b in pairs
        ]
        outs = self._run(self._add_all(prompts, [PoolingParams()] * len(prompts)), use_tqdm)
        return [to_score(o) for o in outs]

    def classify(
        self, prompts: PromptInput | Sequence[PromptInput], use_tqdm: bool = True
    ) -> list[ClassificationRequestOutput]:
        """Each prompt's class probabilities (`outputs.probs`, in the order of the model's
        labels: softmax, or a sigmoid for a single-label or multi-label head), as vLLM's
        `LLM.classify`. Needs a sequence classifier loaded with task="classify"."""
        check_task(self.engine_config.model, ("classify",), "LLM.classify")
        prompts = as_prompt_list(prompts)
        outs = self._run(self._add_all(prompts, [PoolingParams()] * len(prompts)), use_tqdm)
        return [to_classification(o) for o in outs]

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


# The offline call that serves each pooling task.
_POOLING_CALLS = {
    "embed": "embed(prompts)",
    "score": "score(text_1, text_2)",
    "classify": "classify(prompts)",
}
