"""`vllm:`-named copies of the metrics that vLLM also has, with the same meaning.

vLLM's Grafana dashboards, inference-perf's vLLM server type and autoscalers written for vLLM
read `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` and the like. Each alias here is a
copy, made at scrape time, of a `tokenwise:` metric that counts the same thing the same way
(same type, labels, buckets and unit); metrics vLLM has and tokenwise does not are not faked.
`vllm:gpu_cache_usage_perc` (vLLM's older name) and `vllm:time_per_output_token_seconds` (the
older name of the inter-token latency) alias the same metrics as their newer names.
`vllm:prompt_tokens_total` counts every prompt token, prefix-cache hits included, as vLLM's
does; it aliases `tokenwise:prompt_tokens_including_cached`, not `tokenwise:prompt_tokens`
(tokens computed, hits excluded).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

VLLM_ALIASES: dict[str, tuple[str, ...]] = {
    "tokenwise:num_requests_running": ("vllm:num_requests_running",),
    "tokenwise:cache_config_info": ("vllm:cache_config_info",),
    "tokenwise:lora_requests_info": ("vllm:lora_requests_info",),
    "tokenwise:num_requests_waiting": ("vllm:num_requests_waiting",),
    "tokenwise:kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "tokenwise:prefix_cache_queries": ("vllm:prefix_cache_queries",),
    "tokenwise:prefix_cache_hits": ("vllm:prefix_cache_hits",),
    "tokenwise:external_prefix_cache_queries": ("vllm:external_prefix_cache_queries",),
    "tokenwise:external_prefix_cache_hits": ("vllm:external_prefix_cache_hits",),
    "tokenwise:prompt_tokens_including_cached": ("vllm:prompt_tokens",),
    "tokenwise:generation_tokens": ("vllm:generation_tokens",),
    "tokenwise:num_preemptions": ("vllm:num_preemptions",),
    "tokenwise:request_success": ("vllm:request_success",),
    "tokenwise:time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    "tokenwise:inter_token_latency_seconds": (
        "vllm:inter_token_latency_seconds",
        "vllm:time_per_output_token_seconds",
    ),
    "tokenwise:e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "tokenwise:spec_decode_num_drafts": ("vllm:spec_decode_num_drafts",),
    "tokenwise:spec_decode_num_draft_tokens": ("vllm:spec_decode_num_draft_tokens",),
    "tokenwise:spec_decode_num_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens",),
    "tokenwise:spec_decode_num_accepted_tokens_per_pos": (
        "vllm:spec_decode_num_accepted_tokens_per_pos",
    ),
}


def renamed(metric: Metric, name: str) -> Metric:
    """`metric` under another name; its samples keep their suffixes (`_total`, `_bucket`)."""
    copy = Metric(name, f"{metric.documentation} (alias of {metric.name})", metric.type)
    copy.samples = [s._replace(name=name + s.name[len(metric.name) :]) for s in metric.samples]
    return copy


class VllmAliasCollector(Collector):
    """Re-emits the aliased metrics of `sources` under their `vllm:` names."""

    def __init__(self, sources: list[Collector] | None = None) -> None:
        self.sources = list(sources or [])

    def add(self, source: Collector) -> None:
        self.sources.append(source)

    def collect(self) -> Iterator[Metric]:
        for source in self.sources:
            for metric in source.collect():
                for alias in VLLM_ALIASES.get(metric.name, ()):
                    yield renamed(metric, alias)
