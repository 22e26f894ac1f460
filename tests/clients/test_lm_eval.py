"""lm-evaluation-harness (`lm_eval`), its `local-completions` model, against `tokenwise serve`.

Two tasks defined here over local JSONL files (no dataset download): a multiple-choice one,
scored by the log-likelihood of each choice (lm-eval sends the prompt as token ids with
`echo`, `logprobs` and `max_tokens: 1`, and sums the continuation's prompt logprobs), and a
`generate_until` one (greedy, cut at a newline). lm-eval runs as a user runs it, its CLI with
`--output_path`, and the test reads the results and samples it wrote:

- every log-likelihood lm-eval reports equals the sum of the continuation tokens' echo
  logprobs the server returns for the same text, and its accuracy equals the accuracy those
  sums give;
- every generation equals the server's greedy completion of the same prompt, and since half
  the targets are set to those completions beforehand, exact match is exactly 0.5.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests._optional import require
from tests.clients._chat_server import SERVED_NAME
from tests.entrypoints._server import RemoteServer
from tokenwise.default_model import DEFAULT_MODEL_DIR

require("lm_eval", "lm-evaluation-harness (pip install lm-eval)")

WORDS = ["first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth"]
CHOICES = ["alpha", "beta", "gamma"]
MC_DOCS = [
    {"question": f"Q{i}: which is {word}?", "choices": CHOICES, "answer": i % 3}
    for i, word in enumerate(WORDS)
]
GEN_PROMPTS = [f"def {word}(x):\n    return" for word in WORDS]
MAX_GEN_TOKS = 8

MC_TASK = """\
task: tw_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
GEN_TASK = """\
task: tw_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: {max_gen_toks}
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def complete(server: RemoteServer, **body) -> dict:
    response = httpx.post(
        server.url("/v1/completions"), json={"model": SERVED_NAME, **body}, timeout=60
    )
    response.raise_for_status()
    return response.json()["choices"][0]


def continuation_logprob(server: RemoteServer, context: str, continuation: str) -> float:
    """The sum of the echo logprobs of the tokens that start inside `continuation`."""
    logprobs = complete(
        server,
        prompt=context + continuation,
        echo=True,
        logprobs=1,
        max_tokens=1,
        temperature=0.0,
    )["logprobs"]
    offsets, values = logprobs["text_offset"], logprobs["token_logprobs"]
    prompt_end = len(context + continuation)
    return sum(v for o, v in zip(offsets, values, strict=True) if len(context) <= o < prompt_end)


def greedy(server: RemoteServer, prompt: str) -> str:
    return complete(server, prompt=prompt, max_tokens=MAX_GEN_TOKS, stop=["\n"], temperature=0.0)[
        "text"
    ]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.fixture(scope="module")
def run(server: RemoteServer, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Run lm-eval once on both tasks; the greedy completions (half of them the targets)."""
    work = tmp_path_factory.mktemp("lm_eval")
    completions = [greedy(server, prompt) for prompt in GEN_PROMPTS]
    gen_docs = [
        {"question": p, "answer": c if i % 2 == 0 else "<no match>"}
        for i, (p, c) in enumerate(zip(GEN_PROMPTS, completions, strict=True))
    ]
    write_jsonl(work / "mc.jsonl", MC_DOCS)
    write_jsonl(work / "gen.jsonl", gen_docs)
    tasks = work / "tasks"
    tasks.mkdir()
    (tasks / "tw_mc.yaml").write_text(MC_TASK.format(data=work / "mc.jsonl"))
    (tasks / "tw_gen.yaml").write_text(
        GEN_TASK.format(data=work / "gen.jsonl", max_gen_toks=MAX_GEN_TOKS)
    )
    model_args = ",".join([
        f"base_url={server.url('/v1/completions')}",
        f"model={SERVED_NAME}",
        "tokenizer_backend=huggingface",
        f"tokenizer={DEFAULT_MODEL_DIR}",
        "tokenized_requests=True",
        "num_concurrent=1",
        "max_retries=1",
    ])  # fmt: skip
    out = work / "out"
    cmd = [
        sys.executable, "-m", "lm_eval",
        "--model", "local-completions",
        "--model_args", model_args,
        "--tasks", "tw_mc,tw_gen",
        "--include_path", str(tasks),
        "--output_path", str(out),
        "--log_samples",
    ]  # fmt: skip
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(work / "datasets-cache"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    done = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (results_file,) = out.rglob("results_*.json")

    def samples(task: str) -> list[dict]:
        (path,) = out.rglob(f"samples_{task}_*.jsonl")
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        return sorted(rows, key=lambda row: row["doc_id"])

    return {
        "results": json.loads(results_file.read_text())["results"],
        "mc": samples("tw_mc"),
        "gen": samples("tw_gen"),
        "completions": completions,
    }


def test_multiple_choice_loglikelihoods_are_the_servers_echo_logprobs(
    server: RemoteServer, run: dict
) -> None:
    assert len(run["mc"]) == len(MC_DOCS)
    correct = 0
    for sample, doc in zip(run["mc"], MC_DOCS, strict=True):
        context = doc["question"]
        reported = [float(loglik) for loglik, _ in sample["filtered_resps"]]
        expected = [continuation_logprob(server, context, " " + c) for c in CHOICES]
        assert reported == pytest.approx(expected, abs=1e-4)
        correct += max(range(len(CHOICES)), key=lambda k: expected[k]) == doc["answer"]
        assert sample["acc"] == float(max(range(3), key=lambda k: reported[k]) == doc["answer"])
    acc = run["results"]["tw_mc"]["acc,none"]
    assert 0.0 <= acc <= 1.0
    assert acc == pytest.approx(correct / len(MC_DOCS))


def test_generate_until_outputs_are_the_servers_greedy_completions(run: dict) -> None:
    assert len(run["gen"]) == len(GEN_PROMPTS)
    for sample, completion in zip(run["gen"], run["completions"], strict=True):
        assert sample["filtered_resps"] == [completion]
        assert "\n" not in completion
    assert run["results"]["tw_gen"]["exact_match,none"] == pytest.approx(0.5)
