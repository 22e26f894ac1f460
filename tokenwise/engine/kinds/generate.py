"""The generative kind (decoder-only models): prompts in, sampled text out.

Prompt processing validates the prompt and sampling parameters, keys the prefix cache by LoRA
adapter and cache salt, starts the compile of a guided-decoding grammar, and makes one request
per sample (`n`), each with its detokenizer and seed. Outputs carry each sample's new text,
tokens and logprobs, and the timings read off the requests. One KV-cache group (self
attention), the plain runner (no part of its own) and scheduler. The encoder-decoder kind builds on this one.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from tokenwise.engine.detokenizer import IncrementalDetokenizer
from tokenwise.engine.kinds.base import ModelKind, NewRequest, timing_metrics
from tokenwise.engine.output_processor import SampleOutput
from tokenwise.engine.prompts import PromptInput, validate_request
from tokenwise.engine.request import Request
from tokenwise.outputs import CompletionOutput, PromptLogprobs, RequestOutput
from tokenwise.sampling.guided.state import GrammarState
from tokenwise.sampling.params import SamplingParams


class GenerateKind(ModelKind):
    name = "generate"
    # Requests of another kind of model keep their K/V apart: set where a request's K/V depends
    # on more than its tokens (an encoder's input), so no other request may hit its blocks.
    unique_prefix_cache: bool = False

    def process_prompt(
        self, prompt: PromptInput, params: SamplingParams
    ) -> tuple[str | None, list[int], dict[str, Any]]:
        """(prompt text, prompt token ids, extra fields of the requests): none here."""
        engine = self.engine
        if isinstance(prompt, dict) and prompt.get("multi_modal_data"):
            kinds = ", ".join(sorted(prompt["multi_modal_data"])) or "multi-modal data"
            raise ValueError(
                f"this model ({', '.join(engine.model_config.architectures) or 'text-only'}) "
                f"takes text only; the prompt carries {kinds}"
            )
        return (*validate_request(engine.model_config, engine.tokenizer, prompt, params), {})

    def request_cls(self) -> type[Request]:
        return Request

    def make_requests(self, new: NewRequest) -> list[tuple[Request, SampleOutput]]:
        engine = self.engine
        request_id, cache_salt, lora_request = new.request_id, new.cache_salt, new.lora_request
        params = new.params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(
                f"a generative model takes SamplingParams, got {type(params).__name__}; "
                "embeddings come from an embedding model (task='embed')"
            )
        text, token_ids, extra = self.process_prompt(new.prompt, params)
        if lora_request is not None:
            engine.check_lora(lora_request)
            # Blocks computed under one adapter hold other K/V than the base model's: the
            # adapter's id keys the prefix cache, so no two adapters ever share a block.
            cache_salt = f"{cache_salt or ''}|lora:{lora_request.lora_int_id}"
        compiled = None
        if params.guided_decoding is not None:
            compiled = engine.grammar_cache().submit(params.guided_decoding)
        if not engine.config.cache.enable_prefix_caching or self.unique_prefix_cache:
            # Siblings of one request still share their prompt blocks; nobody else can hit them.
            cache_salt = f"{cache_salt or ''}/{uuid.uuid4().hex}"
        arrival = time.monotonic()
        request_cls = self.request_cls()
        samples: list[tuple[Request, SampleOutput]] = []
        for i in range(params.n):
            child_params = params
            if params.n > 1 and params.seed is not None:
                child_params = params.clone()
                child_params.seed = params.seed + i
            req = request_cls(
                request_id=request_id if params.n == 1 else f"{request_id}#{i}",
                prompt_token_ids=token_ids,
                sampling_params=child_params,
                eos_token_ids=engine.eos_token_ids,
                cache_salt=cache_salt,
                lora_request=lora_request,
                arrival_time=arrival,
                group_id=request_id,
                **extra,
            )
            if compiled is not None:
                req.grammar = GrammarState(compiled, engine.eos_token_ids, engine.grammar_timeout_s)
            out = SampleOutput(index=i, prompt=text)
            if engine.tokenizer is not None:
                out.detokenizer = IncrementalDetokenizer.from_params(
                    engine.tokenizer, token_ids, params
                )
            samples.append((req, out))
        return samples

    def make_output(
        self, request_id: str, samples: list[Request], outs: list[SampleOutput]
    ) -> RequestOutput:
        completions = []
        for req, o in zip(samples, outs, strict=True):
            finished_now = req.is_finished and not o.reported_finish
            if not o.new_token_ids and not finished_now:
                continue
            text = o.detokenizer.take_new_text(req.is_finished) if o.detokenizer else ""
            want_lp = req.sampling_params.logprobs is not None
            completions.append(
                CompletionOutput(
                    index=o.index,
                    text=text,
                    token_ids=o.new_token_ids,
                    cumulative_logprob=o.cumulative_logprob if want_lp else None,
                    logprobs=o.new_logprobs if want_lp else None,
                    finish_reason=req.status.finish_reason,
                    stop_reason=req.stop_reason,
                )
            )
            o.new_token_ids = []
            o.new_logprobs = []
            if req.is_finished:
                o.reported_finish = True
        first = samples[0]
        finished = all(r.is_finished for r in samples)
        out = RequestOutput(
            request_id=request_id,
            prompt=outs[0].prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=completions,
            finished=finished,
            num_cached_tokens=max(0, first.num_cached_tokens),
            error=next((r.error for r in samples if r.error), None),
            prompt_logprobs=_take_prompt_logprobs(samples, outs),
        )
        out.metrics.update(timing_metrics(first.arrival_time, outs, finished))
        return out


def _take_prompt_logprobs(
    samples: list[Request], outs: list[SampleOutput]
) -> PromptLogprobs | None:
    """The request's prompt logprobs, once: from the first sample that has scored its whole
    prompt (each sample scores its own, so none waits for a sibling still prefilling)."""
    if samples[0].sampling_params.prompt_logprobs is None or outs[0].prompt_logprobs_reported:
        return None
    for req, o in zip(samples, outs, strict=True):
        scored = o.prompt_logprobs
        if scored is not None and len(scored) == req.num_prompt_tokens:
            outs[0].prompt_logprobs_reported = True
            return scored
    return None
