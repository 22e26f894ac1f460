"""`tokenwise serve --speculative-config`: through the engine-core process, with its metrics."""

from __future__ import annotations

import json
import re

import httpx

from tests.engine._fixtures import LLAMA, checkpoint
from tests.entrypoints._server import RemoteServer
from tokenwise import LLM, SamplingParams

# Text that repeats itself, so the n-gram proposer finds matches.
PROMPT = "one two three four one two three four one two three four one two"
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 8}


def _counter(metrics: str, name: str, prefix: str = "tokenwise") -> float:
    match = re.search(rf"^{prefix}:{name}_total\{{[^}}]*\}} (\S+)$", metrics, re.MULTILINE)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def test_served_greedy_output_and_spec_decode_metrics() -> None:
    path = checkpoint(LLAMA)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    offline = LLM(path, dtype="float32").generate([PROMPT], params, use_tqdm=False)
    expected = offline[0].outputs[0].text
    with RemoteServer(path, "--speculative-config", json.dumps(SPEC)) as server:
        body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
        reply = httpx.post(server.url("/v1/completions"), json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == expected
        metrics = httpx.get(server.url("/metrics"), timeout=10).text
    drafts = _counter(metrics, "spec_decode_num_draft_tokens")
    accepted = _counter(metrics, "spec_decode_num_accepted_tokens")
    assert _counter(metrics, "spec_decode_num_drafts") > 0
    assert 0 <= accepted <= drafts and drafts > 0
    # vLLM's dashboards read the same counters under vLLM's names.
    assert _counter(metrics, "spec_decode_num_draft_tokens", "vllm") == drafts


def test_a_bad_speculative_config_stops_the_cli_with_the_field_named() -> None:
    import subprocess
    import sys

    bad = json.dumps({"method": "ngram", "num_speculative_tokens": 0})
    proc = subprocess.run(
        [sys.executable, "-m", "tokenwise.entrypoints.cli", "serve", "--speculative-config", bad],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "num_speculative_tokens must be an integer >= 1" in proc.stderr
