"""LoRA adapters behind `tokenwise serve`, through the official `openai` client.

Adapters are chosen by the request's `model` field (vLLM's convention), listed by `/v1/models`,
and added or removed at run time when `--allow-runtime-lora-updating` is given. Each adapter's
completion equals the offline `LLM` with the same adapter (itself checked against PEFT in
test_lora_vs_peft.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import cache
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from tests.entrypoints._server import RemoteServer, openai_client
from tests.lora.test_lora_vs_peft import (
    GREEDY,
    adapter_dir,
    adapter_with_unknown_target,
    checkpoint,
    request,
)
from tokenwise import LLM

ARCH = "LlamaForCausalLM"
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    modules = [f"a={adapter_dir(ARCH, 'all-r8')}", f"b={adapter_dir(ARCH, 'attn-r4')}"]
    args = ["--served-model-name", "base", "--enable-lora", "--max-loras", "2"]
    args += ["--max-lora-rank", "8", "--allow-runtime-lora-updating", "--lora-modules", *modules]
    with RemoteServer(checkpoint(ARCH), *args) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> OpenAI:
    return openai_client(server)


@cache
def _offline(adapter: str | None) -> str:
    llm = LLM(checkpoint(ARCH), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8)
    lora = None if adapter is None else request(ARCH, adapter)
    return llm.generate([PROMPT], GREEDY, use_tqdm=False, lora_request=lora)[0].outputs[0].text


def _complete(client: OpenAI, model: str) -> str:
    out = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=GREEDY.max_tokens, temperature=0.0
    )
    return out.choices[0].text


def test_models_lists_the_adapters_under_the_base(client: OpenAI) -> None:
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"base", "a", "b"}
    assert cards["a"].parent == "base" and cards["a"].root == adapter_dir(ARCH, "all-r8")


def test_the_model_field_picks_the_adapter(client: OpenAI) -> None:
    texts = {name: _complete(client, name) for name in ("base", "a", "b")}
    assert texts == {"base": _offline(None), "a": _offline("all-r8"), "b": _offline("attn-r4")}
    assert len(set(texts.values())) == 3


def test_unknown_adapter_is_a_404_in_openai_shape(client: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        _complete(client, "nope")
    assert info.value.body["code"] == "model_not_found" and "'nope'" in info.value.body["message"]


def test_adapters_load_and_unload_at_run_time(
    server: RemoteServer, client: OpenAI, tmp_path: Any
) -> None:
    path = adapter_dir(ARCH, "mlp-r2-rslora")
    load = httpx.post(
        server.url("/v1/load_lora_adapter"), json={"lora_name": "c", "lora_path": path}
    )
    assert load.status_code == 200, load.text
    assert _complete(client, "c") == _offline("mlp-r2-rslora")
    again = httpx.post(
        server.url("/v1/load_lora_adapter"), json={"lora_name": "c", "lora_path": path}
    )
    assert again.status_code == 400 and "already loaded" in again.text
    bad = httpx.post(
        server.url("/v1/load_lora_adapter"), json={"lora_name": "d", "lora_path": "/nope"}
    )
    assert bad.status_code == 400 and "adapter_config.json" in bad.text
    wrong = adapter_with_unknown_target(ARCH, tmp_path)
    bad = httpx.post(
        server.url("/v1/load_lora_adapter"), json={"lora_name": "e", "lora_path": wrong}
    )
    assert bad.status_code == 400 and "qq_proj" in bad.text  # checked against the model
    gone = httpx.post(server.url("/v1/unload_lora_adapter"), json={"lora_name": "c"})
    assert gone.status_code == 200
    with pytest.raises(openai.NotFoundError, match="the model 'c' does not exist"):
        _complete(client, "c")
    missing = httpx.post(server.url("/v1/unload_lora_adapter"), json={"lora_name": "c"})
    assert missing.status_code == 404


def test_lora_requests_info_names_the_running_adapter(server: RemoteServer) -> None:
    """`vllm:lora_requests_info` as llm-d reads it: max_lora and the running adapters."""
    from prometheus_client.parser import text_string_to_metric_families

    def info() -> dict[str, str]:
        families = {f.name: f for f in text_string_to_metric_families(server.metrics())}
        (sample,) = families["vllm:lora_requests_info"].samples
        assert sample.value > 1e9  # a Unix time, as vLLM's: the newest reading wins
        return sample.labels

    idle = info()
    assert idle["max_lora"] == "2" and idle["running_lora_adapters"] == ""
    body = {"model": "a", "prompt": PROMPT, "max_tokens": 400, "stream": True}
    body |= {"ignore_eos": True, "temperature": 0.0}
    with httpx.stream("POST", server.url("/v1/completions"), json=body, timeout=60) as reply:
        chunks = reply.iter_lines()
        next(line for line in chunks if line.startswith("data:"))  # it is running now
        running = info()
    assert running["running_lora_adapters"] == "a" and running["waiting_lora_adapters"] == ""
