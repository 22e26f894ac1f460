"""`tokenwise run-batch`: an OpenAI batch file answered by the server's handlers in-process.

One real run of the CLI on the built-in model (with a chat template) over 100 lines, 3 of them
bad in different ways: every line gets its result in order, the bad ones an error each, and the
run exits 0. The line checks that need no model are tested on `parse_line` directly.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tokenwise.default_model import DEFAULT_MODEL_DIR
from tokenwise.entrypoints.run_batch import parse_line

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
PROMPTS = ["def main():", "import os\n", "class Point:"]
BAD = {9: "invalid_json", 49: "invalid_url", 89: "max_tokens"}  # 0-based line -> error


def batch_lines() -> list[str]:
    lines = []
    for i in range(100):
        custom_id = f"req-{i}"
        if i % 2:
            url = "/v1/completions"
            body = {"model": "default", "prompt": PROMPTS[i % 3], "max_tokens": 3}
        else:
            url = "/v1/chat/completions"
            messages = [{"role": "user", "content": PROMPTS[i % 3]}]
            body = {"model": "default", "messages": messages, "max_tokens": 3}
        body["temperature"] = 0.0
        if i == 49:
            url = "/v1/files"
        if i == 89:
            body["max_tokens"] = -1
        line = json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})
        lines.append("{not json" if i == 9 else line)
    return lines


@pytest.mark.timeout(300)
def test_batch_file_answers_every_line_and_reports_bad_ones(tmp_path) -> None:
    model_dir = str(tmp_path / "default-chat")
    shutil.copytree(DEFAULT_MODEL_DIR, model_dir)
    with open(os.path.join(model_dir, "chat_template.jinja"), "w") as f:
        f.write(CHAT_TEMPLATE)
    in_file, out_file = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    in_file.write_text("\n".join(batch_lines()) + "\n")
    cmd = [sys.executable, "-m", "tokenwise.entrypoints.cli", "run-batch", "-i", str(in_file)]
    cmd += ["-o", str(out_file), "--model", model_dir, "--served-model-name", "default"]
    cmd += ["--device", "cpu", "--dtype", "float32", "--kv-cache-memory", "16MiB"]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "100/100" in done.stderr  # the progress bar reached the end
    assert "97 succeeded, 3 failed" in done.stderr
    results = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert len(results) == 100
    assert [r["custom_id"] for r in results] == [None if i == 9 else f"req-{i}" for i in range(100)]
    assert len({r["id"] for r in results}) == 100
    failed = {i: r for i, r in enumerate(results) if r["error"] is not None}
    assert sorted(failed) == sorted(BAD)
    assert failed[9]["error"]["code"] == "invalid_json" and failed[9]["response"] is None
    assert (
        failed[49]["error"]["code"] == "invalid_url"
        and "/v1/files" in failed[49]["error"]["message"]
    )
    refused = failed[89]["response"]
    assert refused["status_code"] == 400 and refused["body"]["error"]["param"] == "max_tokens"
    assert "max_tokens" in failed[89]["error"]["message"]
    texts: dict[tuple[str, str], set[str]] = {}
    for i, result in enumerate(results):
        if i in BAD:
            continue
        response = result["response"]
        assert response["status_code"] == 200 and response["request_id"] == response["body"]["id"]
        body = response["body"]
        assert 1 <= body["usage"]["completion_tokens"] <= 3
        if i % 2:
            assert body["object"] == "text_completion"
            text = body["choices"][0]["text"]
        else:
            assert body["object"] == "chat.completion"
            text = body["choices"][0]["message"]["content"]
        texts.setdefault((response["body"]["object"], PROMPTS[i % 3]), set()).add(text)
    # Greedy: the same request gives the same text wherever it sits in the batch.
    assert len(texts) == 6 and all(len(found) == 1 for found in texts.values())
    assert len({next(iter(found)) for found in texts.values()}) > 1


@pytest.mark.parametrize(
    ("line", "code", "says"),
    [
        ('["a"]', "invalid_request", "JSON object"),
        ('{"method": "POST", "url": "/v1/completions", "body": {}}', "invalid_request", "custom_id"),
        ('{"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}}', "invalid_request", "method"),
        ('{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": 3}', "invalid_request", "body"),
        ('{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"stream": true}}', "invalid_request", "body.stream"),
        ('{"custom_id": "dup", "method": "POST", "url": "/v1/completions", "body": {}}', "duplicate_custom_id", "dup"),
    ],
)  # fmt: skip
def test_lines_that_are_not_requests_are_named(line: str, code: str, says: str) -> None:
    result = parse_line(line, 7, seen={"dup"})
    assert result["error"]["code"] == code and result["response"] is None
    assert result["error"]["message"].startswith("line 7: ") and says in result["error"]["message"]


def test_a_good_line_is_a_request() -> None:
    seen: set[str] = set()
    line = '{"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}'
    assert parse_line(line, 1, seen) == {
        "custom_id": "a",
        "url": "/v1/embeddings",
        "body": {"input": "x"},
    }
    assert seen == {"a"}
