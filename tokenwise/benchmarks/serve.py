"""`tokenwise bench serve`: load a running OpenAI-compatible server and time every token.

Each request is a streaming `/v1/completions` call (greedy, `ignore_eos`, exactly
`max_tokens` tokens). The client stamps the send time and the arrival of every streamed chunk
that carries text; from those stamps (see `request_metrics`):

- TTFT, time to first token: first text chunk - send time (queueing + prefill + network).
- ITL, inter-token latency: gaps between consecutive text chunks, pooled over all requests (a
  chunk carrying several tokens counts as one gap, so ITL shows stalls as the user sees them).
- E2E latency: last text chunk - send time.
- TPOT, time per output token after the first: (E2E - TTFT) / (output tokens - 1); requests
  with a single output token have none.

Output token counts come from the server's final `usage` chunk (`stream_options.include_usage`)
and fall back to the number of text chunks when the server sends none.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from tokenwise.benchmarks.common import (
    add_workload_args,
    length_ranges,
    make_workload,
    summarize,
    write_json,
)
from tokenwise.entrypoints.engine_args import positive_int

WORDS = "the of and to in is was for on that with as by at from his her an it are be".split()


@dataclass
class RequestRecord:
    """What the client saw of one request: all times are `time.perf_counter()` seconds."""

    start: float
    prompt_len: int
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int | None = None  # from `usage`; None when the server sent no usage
    prompt_tokens: int | None = None
    error: str | None = None

    @property
    def success(self) -> bool:
        return self.error is None and bool(self.chunk_times)

    @property
    def num_output_tokens(self) -> int:
        return self.output_tokens if self.output_tokens is not None else len(self.chunk_times)


def request_metrics(rec: RequestRecord) -> dict[str, Any]:
    """TTFT, E2E and TPOT (seconds, TPOT None below two tokens) and the ITL gaps of one
    successful request."""
    times = rec.chunk_times
    ttft = times[0] - rec.start
    e2e = times[-1] - rec.start
    n = rec.num_output_tokens
    tpot = (e2e - ttft) / (n - 1) if n > 1 else None
    itls = [b - a for a, b in zip(times, times[1:], strict=False)]
    return {"ttft": ttft, "e2e": e2e, "tpot": tpot, "itls": itls}


def aggregate(records: list[RequestRecord], duration: float) -> dict[str, Any]:
    """Throughputs over the whole run and mean/median/p99 (ms) of each latency metric."""
    done = [r for r in records if r.success]
    per_request = [request_metrics(r) for r in done]
    prompt_tokens = sum(r.prompt_tokens or r.prompt_len for r in done)
    output_tokens = sum(r.num_output_tokens for r in done)
    duration = max(duration, 1e-9)
    out: dict[str, Any] = {
        "duration": duration,
        "completed": len(done),
        "failed": len(records) - len(done),
        "total_input_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration,
    }
    series = {
        "ttft": [m["ttft"] for m in per_request],
        "tpot": [m["tpot"] for m in per_request if m["tpot"] is not None],
        "itl": [gap for m in per_request for gap in m["itls"]],
        "e2el": [m["e2e"] for m in per_request],
    }
    for name, values in series.items():
        stats = summarize([v * 1000.0 for v in values], (99,))
        out[f"mean_{name}_ms"] = stats["mean"]
        out[f"median_{name}_ms"] = stats["median"]
        out[f"p99_{name}_ms"] = stats["p99"]
    errors = [r.error for r in records if r.error]
    if errors:
        out["first_error"] = errors[0]
    return out


def _base_url(text: str) -> str:
    if not text.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"expected an http(s):// URL, got {text!r}")
    return text.rstrip("/")


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--base-url", type=_base_url, default="http://127.0.0.1:8000", help="server address"
    )
    parser.add_argument("--model", default=None, help="model name (default: first of /v1/models)")
    parser.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument("--num-prompts", type=positive_int, default=64, help="requests (64)")
    parser.add_argument(
        "--max-concurrency", type=positive_int, default=None, help="most requests in flight"
    )
    parser.add_argument(
        "--request-rate",
        type=_positive_float,
        default=float("inf"),
        help="Poisson arrivals per second (default: all at once)",
    )
    add_workload_args(parser, input_len=128, output_len=128)
    parser.add_argument(
        "--prompt-type",
        choices=["token-ids", "words"],
        default="token-ids",
        help="random token ids (exact lengths) or words (about one token each)",
    )
    parser.add_argument(
        "--vocab-size", type=positive_int, default=1000, help="token ids are below this (1000)"
    )
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    parser.add_argument("--timeout", type=_positive_float, default=600.0, help="per request, s")
    parser.add_argument("--output-json", default=None, metavar="PATH", help="write results here")


async def _one_request(client: Any, body: dict[str, Any], prompt_len: int) -> RequestRecord:
    rec = RequestRecord(start=time.perf_counter(), prompt_len=prompt_len)
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                rec.error = f"HTTP {response.status_code}: {text[:200]}"
                return rec
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[len("data:") :].strip()
                if payload == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(payload)
                if any(c.get("text") for c in chunk.get("choices") or []):
                    rec.chunk_times.append(now)
                usage = chunk.get("usage")
                if usage:
                    rec.output_tokens = usage.get("completion_tokens")
                    rec.prompt_tokens = usage.get("prompt_tokens")
        if not rec.chunk_times:
            rec.error = "the stream ended without any text"
    except Exception as exc:  # one failed request must not end the benchmark
        rec.error = f"{type(exc).__name__}: {exc}"
    return rec


async def _served_model(client: Any) -> str | None:
    try:
        response = await client.get("/v1/models")
        return response.json()["data"][0]["id"]
    except Exception:
        return None  # the completion request then omits the name


async def run_benchmark(args: argparse.Namespace, transport: Any = None) -> dict[str, Any]:
    """Send the workload and return `aggregate(...)` plus the run's settings. `transport` lets
    tests substitute an in-process fake server."""
    import httpx

    input_range, output_range = length_ranges(args)
    workload = make_workload(
        args.num_prompts, input_range, output_range, args.vocab_size, args.seed
    )
    rng = random.Random(args.seed)
    limit = asyncio.Semaphore(args.max_concurrency or args.num_prompts)
    timeout = httpx.Timeout(args.timeout)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    async with httpx.AsyncClient(
        base_url=args.base_url, timeout=timeout, transport=transport, headers=headers
    ) as client:
        model = args.model or await _served_model(client)

        async def send(req: Any) -> RequestRecord:
            prompt: Any = req.prompt_token_ids
            if args.prompt_type == "words":
                prompt = " ".join(WORDS[i % len(WORDS)] for i in req.prompt_token_ids)
            body: dict[str, Any] = {
                "prompt": prompt,
                "max_tokens": req.output_len,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            if model:
                body["model"] = model
            async with limit:
                return await _one_request(client, body, req.prompt_len)

        start = time.perf_counter()
        tasks = []
        for req in workload:
            tasks.append(asyncio.create_task(send(req)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        records = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    results = aggregate(list(records), duration)
    results["config"] = {
        "base_url": args.base_url,
        "model": model,
        "num_prompts": args.num_prompts,
        "max_concurrency": args.max_concurrency,
        "request_rate": str(args.request_rate),
        "input_len": list(input_range),
        "output_len": list(output_range),
        "prompt_type": args.prompt_type,
        "seed": args.seed,
    }
    return results


def print_report(r: dict[str, Any]) -> None:
    print(f"{' Serving Benchmark Result ':=^50}")
    rows = [
        ("Successful requests:", r["completed"]),
        ("Failed requests:", r["failed"]),
        ("Benchmark duration (s):", f"{r['duration']:.2f}"),
        ("Total input tokens:", r["total_input_tokens"]),
        ("Total generated tokens:", r["total_output_tokens"]),
        ("Request throughput (req/s):", f"{r['request_throughput']:.2f}"),
        ("Output token throughput (tok/s):", f"{r['output_throughput']:.2f}"),
        ("Total token throughput (tok/s):", f"{r['total_token_throughput']:.2f}"),
    ]
    for label, value in rows:
        print(f"{label:<40}{value:>10}")
    titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)"}
    titles |= {"itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    for key, title in titles.items():
        print(f"{' ' + title + ' ':-^50}")
        for stat in ("mean", "median", "p99"):
            label = f"{stat.capitalize() if stat != 'p99' else 'P99'} {key.upper()} (ms):"
            print(f"{label:<40}{r[f'{stat}_{key}_ms']:>10.2f}")
    print("=" * 50)


def run(args: argparse.Namespace) -> int:
    results = asyncio.run(run_benchmark(args))
    print_report(results)
    write_json(args.output_json, results)
    if results["completed"] == 0:
        print(
            f"tokenwise: error: no request succeeded against {args.base_url}: "
            f"{results.get('first_error', 'no response')}",
            file=sys.stderr,
        )
        return 1
    return 0
