"""Prometheus metrics for `/metrics`, named like vLLM's with a `tokenwise:` prefix.

Two sources feed them:
- the engine's own cumulative statistics (queue sizes, KV-cache use, token and prefix-cache
  counters, finish reasons) and the forward-time-per-batch-size table, read at scrape time by a
  custom collector, so the exposition never drifts from what the engine counted;
- per-request latencies (time to first token, inter-token latency, end-to-end), observed into
  histograms from every engine output as the engine thread publishes it.

Those vLLM also has are exported a second time under their `vllm:` names (`metrics_aliases`).

Each app gets a private `CollectorRegistry`, so several servers (or tests) can coexist in one
process without "duplicated timeseries" errors from the global registry.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenwise.batchsize_stats import get_batchsize_forward_time_summary
from tokenwise.config import CacheConfig
from tokenwise.engine.stats import EngineStats
from tokenwise.entrypoints.openai.metrics_aliases import VllmAliasCollector
from tokenwise.outputs import RequestOutput

PREFIX = "tokenwise:"
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class _EngineCollector(Collector):
    """Reads the engine's statistics snapshot at scrape time."""

    def __init__(
        self,
        model_name: str,
        stats: Callable[[], EngineStats],
        forward_times: Callable[[], dict[int, tuple[int, float]]],
        cache_config: CacheConfig | None = None,
        max_loras: int | None = None,
    ) -> None:
        self.model_name = model_name
        self.stats = stats
        self.forward_times = forward_times
        self.cache_config = cache_config
        self.max_loras = max_loras

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
        family.add_metric([self.model_name], value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
        family.add_metric([self.model_name], value)
        return family

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        used = s.num_total_blocks - s.num_free_blocks
        yield self._gauge("num_requests_running", "Requests in the running batch.", s.num_running)
        yield self._gauge(
            "num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting
        )
        yield self._gauge(
            "kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", s.kv_cache_usage
        )
        yield self._gauge("num_used_kv_blocks", "KV blocks held by requests.", used)
        yield self._gauge("num_total_kv_blocks", "KV blocks in the cache.", s.num_total_blocks)
        yield self._counter(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            s.prefix_cache_queries,
        )
        yield self._counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits
        )
        yield from self._kv_tier(s)
        yield self._counter(
            "prompt_tokens",
            "Prompt tokens computed (prefix-cache hits excluded).",
            s.prompt_tokens_total,
        )
        yield self._counter("generation_tokens", "Tokens generated.", s.generation_tokens_total)
        yield self._counter("num_preemptions", "Requests preempted.", s.num_preemptions_total)
        success = CounterMetricFamily(
            PREFIX + "request_success",
            "Finished sequences by finish reason.",
            labels=["model_name", "finished_reason"],
        )
        for reason, count in sorted(s.finished_reasons.items()):
            success.add_metric([self.model_name, reason], count)
        yield success
        yield from self._spec_decode(s)
        yield from self._forward_times()
        yield from self._info(s)

    def _info(self, s: EngineStats) -> Iterator[Metric]:
        """vLLM's info gauges, which routers read for their labels (llm-d's scheduler: block
        size and count for prefix scoring, the adapters in use for LoRA affinity)."""
        c = self.cache_config
        if c is not None:
            labels = {
                "block_size": str(c.block_size),
                "cache_dtype": c.cache_dtype,
                "enable_prefix_caching": str(c.enable_prefix_caching),
                "gpu_memory_utilization": str(c.gpu_memory_utilization),
                "num_gpu_blocks": str(s.num_total_blocks),
            }
            info = GaugeMetricFamily(
                PREFIX + "cache_config_info", "Information of the KV cache.", labels=list(labels)
            )
            info.add_metric(list(labels.values()), 1.0)
            yield info
        if self.max_loras is not None:
            # As vLLM: the value is the time of the reading, the adapters comma-joined.
            lora = GaugeMetricFamily(
                PREFIX + "lora_requests_info",
                "LoRA adapters of the running and waiting requests.",
                labels=["running_lora_adapters", "max_lora", "waiting_lora_adapters"],
            )
            lora.add_metric(
                [
                    ",".join(s.running_lora_adapters),
                    str(self.max_loras),
                    ",".join(s.waiting_lora_adapters),
                ],
                time.time(),
            )
            yield lora

    def _kv_tier(self, s: EngineStats) -> Iterator[Metric]:
        """With a second KV tier (`--kv-offloading-size`): vLLM's external_prefix_cache_*
        counters (tokens the pool missed and the tier was asked for; tokens it served), and
        the prefix-cache hits split by the tier that served them."""
        if not s.kv_tier_name:
            return
        pool_hits = s.prefix_cache_hits - s.prefix_cache_tier_hits
        asked = s.prefix_cache_queries - pool_hits
        for name, doc, value in (
            ("queries", "Prompt tokens the KV cache missed and the KV tier was asked for.", asked),
            ("hits", "Prompt tokens loaded back from the KV tier.", s.prefix_cache_tier_hits),
        ):
            yield self._counter("external_prefix_cache_" + name, doc, value)
        by_tier = CounterMetricFamily(
            PREFIX + "prefix_cache_hits_by_tier",
            "Prompt tokens found in the prefix cache, by the tier that held them.",
            labels=["model_name", "tier"],
        )
        by_tier.add_metric([self.model_name, "kv_cache"], pool_hits)
        by_tier.add_metric([self.model_name, s.kv_tier_name], s.prefix_cache_tier_hits)
        yield by_tier

    def _spec_decode(self, s: EngineStats) -> Iterator[Metric]:
        """vLLM's spec_decode_* counters (zero while speculative decoding is off)."""
        yield self._counter(
            "spec_decode_num_drafts",
            "Request steps that verified drafts.",
            s.spec_decode_num_drafts,
        )
        yield self._counter(
            "spec_decode_num_draft_tokens",
            "Draft tokens verified.",
            s.spec_decode_num_draft_tokens,
        )
        yield self._counter(
            "spec_decode_num_accepted_tokens",
            "Draft tokens accepted.",
            s.spec_decode_num_accepted_tokens,
        )
        per_pos = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by their position among a step's drafts (0 = first).",
            labels=["model_name", "position"],
        )
        for pos, count in enumerate(s.spec_decode_num_accepted_tokens_per_pos):
            per_pos.add_metric([self.model_name, str(pos)], count)
        yield per_pos

    def _forward_times(self) -> Iterator[Metric]:
        labels = ["model_name", "batch_size"]
        median = GaugeMetricFamily(
            PREFIX + "forward_time_per_batch_size_milliseconds",
            "Median forward-pass time per batch size (tokens in the pass).",
            labels=labels,
        )
        count = CounterMetricFamily(
            PREFIX + "forward_passes", "Forward passes per batch size.", labels=labels
        )
        for size, (passes, median_ms) in sorted(self.forward_times().items()):
            median.add_metric([self.model_name, str(size)], median_ms)
            count.add_metric([self.model_name, str(size)], passes)
        yield median
        yield count


class ServerMetrics:
    """The registry of one app plus the latency bookkeeping fed by `observe`."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        kwargs = {"labelnames": ["model_name"], "registry": self.registry}
        families = [
            Histogram(
                PREFIX + "time_to_first_token_seconds",
                "Time from arrival to the first generated token.",
                buckets=TTFT_BUCKETS,
                **kwargs,
            ),
            Histogram(
                PREFIX + "inter_token_latency_seconds",
                "Time between consecutive tokens of a sequence.",
                buckets=ITL_BUCKETS,
                **kwargs,
            ),
            Histogram(
                PREFIX + "e2e_request_latency_seconds",
                "Time from arrival to the end of the request.",
                buckets=E2E_BUCKETS,
                **kwargs,
            ),
            # The engine's prompt_tokens counts tokens computed; this one (vLLM's meaning)
            # counts every prompt token once per request, prefix-cache hits included.
            Counter(
                PREFIX + "prompt_tokens_including_cached",
                "Prompt tokens of requests, prefix-cache hits included.",
                **kwargs,
            ),
        ]
        self.ttft, self.itl, self.e2e, self.prompt_tokens = (
            family.labels(model_name) for family in families
        )
        self.aliases = VllmAliasCollector(families)
        self.registry.register(self.aliases)
        self._lock = threading.Lock()
        self._first_seen: set[str] = set()
        self._last_token: dict[str, dict[int, float]] = {}  # request -> sample -> time

    def attach_engine(
        self,
        stats: Callable[[], EngineStats],
        forward_times: Callable[[], dict[int, tuple[int, float]]] | None = None,
        cache_config: CacheConfig | None = None,
        max_loras: int | None = None,
    ) -> None:
        """`forward_times`: batch size -> (passes, median ms), read at scrape time; by default
        this process's (an engine core in another process reports its own). `cache_config`
        labels `cache_config_info`; `max_loras` (LoRA on) turns on `lora_requests_info`."""
        forward_times = forward_times or get_batchsize_forward_time_summary
        collector = _EngineCollector(self.model_name, stats, forward_times, cache_config, max_loras)
        self.registry.register(collector)
        self.aliases.add(collector)

    def observe(self, output: RequestOutput, now: float | None = None) -> None:
        """Record the latencies one engine delta reveals (called on the engine thread)."""
        now = time.monotonic() if now is None else now
        rid = output.request_id
        with self._lock:
            ttft = output.metrics.get("time_to_first_token")
            if ttft is not None and rid not in self._first_seen:
                self._first_seen.add(rid)
                self.ttft.observe(ttft)
            if rid not in self._last_token:  # the request's first output
                self.prompt_tokens.inc(len(output.prompt_token_ids or ()))
            last_times = self._last_token.setdefault(rid, {})
            # An embedding output has one EmbeddingOutput and no tokens to time.
            completions = output.outputs if isinstance(output.outputs, list) else []
            for completion in completions:
                num_tokens = len(completion.token_ids)
                if not num_tokens:
                    continue
                last = last_times.get(completion.index)
                if last is not None:
                    for _ in range(num_tokens):
                        self.itl.observe((now - last) / num_tokens)
                last_times[completion.index] = now
            if output.finished:
                if "e2e_latency" in output.metrics:
                    self.e2e.observe(output.metrics["e2e_latency"])
                self._first_seen.discard(rid)
                self._last_token.pop(rid, None)

    def render(self) -> bytes:
        return generate_latest(self.registry)
