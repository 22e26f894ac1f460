"""guidellm (vLLM's load generator), its default chat workload, against `tokenwise serve`.

guidellm's default request format is streamed `/v1/chat/completions` with
`stream_options.continuous_usage_stats` and `ignore_eos`, and it counts tokens from the
server's usage. guidellm has no default load profile; a concurrent one (4 streams) keeps the
run short. It runs offline here: synthetic prompts of a set token length, the built-in
model's tokenizer directory as the processor (nothing is downloaded), a fixed request count.
The test reads guidellm's JSON report: every request completed, none errored or incomplete,
each produced exactly the requested output tokens, and each prompt's token count equals what
the server's /tokenize counts for the same messages.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx

from tests._optional import require
from tests.clients._chat_server import SERVED_NAME
from tests.entrypoints._server import RemoteServer
from tokenwise.default_model import DEFAULT_MODEL_DIR

require("guidellm", "guidellm (pip install guidellm)")

REQUESTS = 16
PROMPT_TOKENS = 32
OUTPUT_TOKENS = 8


def test_default_chat_workload_completes_every_request(server: RemoteServer, tmp_path) -> None:
    report = tmp_path / "benchmarks.json"
    cmd = [
        sys.executable, "-m", "guidellm", "run",
        "--backend", f"kind=openai_http,target={server.base_url},model={SERVED_NAME}",
        "--profile", "kind=concurrent,streams=4",
        "--constraint", f"kind=max_requests,count={REQUESTS}",
        "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},"
                  f"output_tokens={OUTPUT_TOKENS}",
        "--tokenizer", f"kind=huggingface_auto,model={DEFAULT_MODEL_DIR}",
        "--output", f"kind=json,path={report}",
        "--disable-console",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    (benchmark,) = json.loads(report.read_text())["benchmarks"]
    backend = benchmark["config"]["backend"]
    assert backend["request_format"] == "/v1/chat/completions" and backend["stream"]
    assert benchmark["metrics"]["request_totals"] == {
        "successful": REQUESTS,
        "errored": 0,
        "incomplete": 0,
        "total": REQUESTS,
    }
    requests = benchmark["requests"]
    assert len(requests["successful"]) == REQUESTS
    assert not requests["errored"] and not requests["incomplete"]
    for stats in requests["successful"]:
        assert stats["info"]["status"] == "completed" and stats["info"]["error"] is None
        assert stats["output_metrics"]["text_tokens"] == OUTPUT_TOKENS
        body = json.loads(stats["request_args"])["body"]
        assert body["stream_options"]["continuous_usage_stats"] is True
        counted = httpx.post(
            server.url("/tokenize"),
            json={"model": SERVED_NAME, "messages": body["messages"]},
            timeout=30,
        ).json()["count"]
        assert stats["input_metrics"]["text_tokens"] == counted
