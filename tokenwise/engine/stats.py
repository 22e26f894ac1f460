"""Engine statistics: a snapshot per step, cumulative counters, and a periodic log line.

The snapshot is plain data so the server's `/metrics` can read it; the log line gives the same
numbers to someone watching a terminal, at most once per `log_interval_s` while busy.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tokenwise.engine.request import Request

logger = logging.getLogger("tokenwise.engine")


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    prefix_cache_queries: int = 0  # cumulative prompt tokens looked up
    prefix_cache_hits: int = 0  # cumulative prompt tokens found cached
    # Of those, tokens loaded back from the second KV tier (`--kv-offloading-size`), and the
    # tier's name ("cpu", "disk"; empty: no tier).
    prefix_cache_tier_hits: int = 0
    kv_tier_name: str = ""
    prompt_tokens_total: int = 0  # cumulative prompt tokens computed (hits excluded)
    generation_tokens_total: int = 0
    num_preemptions_total: int = 0
    num_steps_total: int = 0
    num_ubatched_steps_total: int = 0  # steps run as two micro-batches (DP + MoE only)
    num_dummy_steps_total: int = 0  # dummy passes of a DP rank joining its peers' (MoE only)
    finished_reasons: dict[str, int] = field(default_factory=dict)
    # Speculative decoding (vLLM's spec_decode_* figures): steps of a request that verified
    # drafts, drafts verified, drafts accepted, and accepted ones by their position (0 = first).
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    # LoRA adapters (names, sorted) of the running and waiting requests: what a cluster
    # router reads from `vllm:lora_requests_info` to send a request where its adapter is.
    running_lora_adapters: list[str] = field(default_factory=list)
    waiting_lora_adapters: list[str] = field(default_factory=list)

    def refresh(
        self,
        scheduler: Any,
        block_manager: Any,
        *,
        kv_tier_name: str,
        num_ubatched_steps: int,
        lora: bool,
    ) -> EngineStats:
        """These figures, with the gauges read now from the engine's scheduler and block
        manager (or their per-virtual-engine views); returns self."""
        self.num_running = len(scheduler.running)
        self.num_waiting = len(scheduler.waiting)
        self.kv_cache_usage = block_manager.usage
        self.num_free_blocks = block_manager.get_num_free_blocks()
        self.prefix_cache_queries = block_manager.prefix_cache_queries
        self.prefix_cache_hits = block_manager.prefix_cache_hits
        self.prefix_cache_tier_hits = block_manager.prefix_cache_tier_hits
        self.kv_tier_name = kv_tier_name
        self.num_ubatched_steps_total = num_ubatched_steps
        if lora:
            self.running_lora_adapters = lora_adapter_names(scheduler.running)
            self.waiting_lora_adapters = lora_adapter_names(scheduler.waiting)
        return self

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )


class StatLogger:
    def __init__(self, log_interval_s: float = 10.0) -> None:
        self.log_interval_s = log_interval_s
        self._last_time = time.monotonic()
        self._last_prompt = 0
        self._last_generation = 0
        self._last_drafts = self._last_draft_tokens = self._last_accepted = 0
        self._last_per_pos: list[int] = []

    def maybe_log(self, stats: EngineStats, now: float | None = None) -> str | None:
        now = time.monotonic() if now is None else now
        elapsed = now - self._last_time
        if elapsed < self.log_interval_s:
            return None
        prompt_tps = (stats.prompt_tokens_total - self._last_prompt) / elapsed
        gen_tps = (stats.generation_tokens_total - self._last_generation) / elapsed
        self._last_time = now
        self._last_prompt = stats.prompt_tokens_total
        self._last_generation = stats.generation_tokens_total
        line = (
            f"Avg prompt throughput: {prompt_tps:.1f} tokens/s, "
            f"Avg generation throughput: {gen_tps:.1f} tokens/s, "
            f"Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
            f"KV cache usage: {stats.kv_cache_usage * 100:.1f}%, "
            f"Prefix cache hit rate: {stats.prefix_cache_hit_rate * 100:.1f}%"
        )
        line += self._spec_decode_part(stats)
        logger.info(line)
        return line

    def _spec_decode_part(self, stats: EngineStats) -> str:
        """Drafts since the last line: acceptance rate, mean accepted length, per position."""
        drafts = stats.spec_decode_num_drafts - self._last_drafts
        if drafts <= 0:
            return ""
        proposed = stats.spec_decode_num_draft_tokens - self._last_draft_tokens
        accepted = stats.spec_decode_num_accepted_tokens - self._last_accepted
        per_pos = stats.spec_decode_num_accepted_tokens_per_pos
        last = self._last_per_pos + [0] * (len(per_pos) - len(self._last_per_pos))
        rates = ", ".join(
            f"{(now - then) / drafts:.2f}" for now, then in zip(per_pos, last, strict=True)
        )
        self._last_drafts = stats.spec_decode_num_drafts
        self._last_draft_tokens = stats.spec_decode_num_draft_tokens
        self._last_accepted = stats.spec_decode_num_accepted_tokens
        self._last_per_pos = list(per_pos)
        return (
            f", Spec decode: acceptance rate {accepted / max(proposed, 1) * 100:.1f}%, "
            f"mean acceptance length {1 + accepted / drafts:.2f}, per position [{rates}]"
        )


def finished_request_line(
    request_id: str, samples: list[Request], first_token_times: list[float | None], now: float
) -> str:
    """`request r1 finished: stop, 12 prompt + 40 output tokens, ttft 0.031 s, total 0.412 s`.

    With `n > 1` the output tokens are the samples' sum, the reasons each distinct one (in
    sample order, "/"-joined) and the ttft the earliest sample's; "ttft -" when no token came
    (aborted or failed while waiting, or an embedding). `first_token_times[i]`: when
    sample i's first token came (None: none came).
    """
    first = samples[0]
    reasons = dict.fromkeys(r.status.finish_reason or "unknown" for r in samples)
    output_tokens = sum(r.num_output_tokens for r in samples)
    first_tokens = [t for t in first_token_times if t is not None]
    ttft = f"{min(first_tokens) - first.arrival_time:.3f} s" if first_tokens else "-"
    return (
        f"request {request_id} finished: {'/'.join(reasons)}, {first.num_prompt_tokens} "
        f"prompt + {output_tokens} output tokens, ttft {ttft}, "
        f"total {now - first.arrival_time:.3f} s"
    )


def lora_adapter_names(requests: Iterable[Request]) -> list[str]:
    """The distinct LoRA adapter names of `requests` (scheduler requests), sorted."""
    return sorted({r.lora_request.lora_name for r in requests if r.lora_request is not None})


def combine_stats(per_core: list[EngineStats]) -> EngineStats:
    """Counters summed over cores (DP ranks); KV usage is the pooled fraction of all their
    blocks. One core's stats are returned as they are."""
    if len(per_core) == 1:
        return per_core[0]
    total = EngineStats()
    for s in per_core:
        for name in (
            "num_running",
            "num_waiting",
            "num_free_blocks",
            "num_total_blocks",
            "prefix_cache_queries",
            "prefix_cache_hits",
            "prefix_cache_tier_hits",
            "prompt_tokens_total",
            "generation_tokens_total",
            "num_preemptions_total",
            "num_steps_total",
            "num_ubatched_steps_total",
            "num_dummy_steps_total",
            "spec_decode_num_drafts",
            "spec_decode_num_draft_tokens",
            "spec_decode_num_accepted_tokens",
        ):
            setattr(total, name, getattr(total, name) + getattr(s, name))
        for reason, count in s.finished_reasons.items():
            total.finished_reasons[reason] = total.finished_reasons.get(reason, 0) + count
        for name in ("running_lora_adapters", "waiting_lora_adapters"):
            setattr(total, name, sorted(set(getattr(total, name)) | set(getattr(s, name))))
        total.kv_tier_name = total.kv_tier_name or s.kv_tier_name
        per_pos = total.spec_decode_num_accepted_tokens_per_pos
        for pos, count in enumerate(s.spec_decode_num_accepted_tokens_per_pos):
            if pos == len(per_pos):
                per_pos.append(0)
            per_pos[pos] += count
    if total.num_total_blocks:
        total.kv_cache_usage = 1.0 - total.num_free_blocks / total.num_total_blocks
    return total
