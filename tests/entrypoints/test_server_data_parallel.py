"""`tokenwise serve --data-parallel-size 2` on an MoE model: the server over two lock-step ranks.

Expected text comes from a single in-process engine on the same checkpoint, so a server whose
ranks routed, stepped or combined wrongly fails; requests are sent concurrently so that both
ranks hold work at once, and one alone so that one rank idles while the other generates.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from openai import OpenAI

from tests.entrypoints._server import RemoteServer
from tests.tiny_checkpoints import build_tiny_checkpoint
from tokenwise.entrypoints.llm import LLM
from tokenwise.sampling.params import SamplingParams

NAME = "tiny-moe"
PROMPTS = ["Hello world", "The cat sat on", "One two three", "A B C D E F"]
GREEDY = {"temperature": 0.0, "max_tokens": 8, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("dp-server"), "Qwen3MoeForCausalLM")


@pytest.fixture(scope="module")
def client(model_dir: str):
    args = ("--served-model-name", NAME, "--data-parallel-size", "2")
    with RemoteServer(model_dir, *args) as server:
        yield OpenAI(base_url=server.url("/v1"), api_key="x", timeout=60.0, max_retries=0)


def test_dp_server_answers_like_one_engine(model_dir: str, client: OpenAI) -> None:
    llm = LLM(model_dir, dtype="float32", device="cpu", kv_cache_memory=16 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]

    def complete(prompt: str) -> str:
        out = client.completions.create(model=NAME, prompt=prompt, **GREEDY)
        assert out.choices[0].finish_reason == "length"
        assert out.usage.completion_tokens == 8
        return out.choices[0].text

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        assert list(pool.map(complete, PROMPTS)) == expected
    # Alone: one rank idles (dummy passes) while the other generates, streamed this time.
    stream = client.completions.create(model=NAME, prompt=PROMPTS[2], stream=True, **GREEDY)
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == expected[2]
