"""Ray Serve: `build_openai_app` on a local Ray instance, one replica.

The replica serves the tiny test checkpoint (the built-in model has no chat template, so it
cannot answer a chat). A chat completion and a completion through the OpenAI client must come
back from the replica under the `model_id` with the greedy text the model gives in this
process, `/v1/models` must name the `model_id`, and shutting Serve down
must leave no actor and no reserved CPU. Misspelled options fail on the driver, before any replica starts.
"""

from __future__ import annotations

import time

import pytest

from tests._optional import require
from tests.engine._fixtures import checkpoint
from tokenwise.distributed.tp_state import free_port
from tokenwise.ray_serve import LLMConfig, build_openai_app

ray = require("ray", "Ray Serve's test needs .[ray]")
serve = require("ray.serve", "Ray Serve's test needs .[ray] (ray[serve])")
openai = require("openai")

MODEL_ID = "tiny-chat"
PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "Hello tokenwise"}]
ENGINE = {"dtype": "float32", "num_gpu_blocks": 64}


def _config(model: str = "default", **engine: object) -> LLMConfig:
    return LLMConfig(
        model_loading_config={"model_id": MODEL_ID, "model_source": model},
        engine_kwargs={**ENGINE, **engine},
        deployment_config={
            "num_replicas": 1,
            # One engine in the replica's process: no core process to spawn inside the actor.
            "ray_actor_options": {
                "num_cpus": 1,
                "runtime_env": {"env_vars": {"TOKENWISE_ENABLE_MULTIPROCESSING": "0"}},
            },
        },
    )


def _reserved_cpus() -> float:
    return ray.cluster_resources()["CPU"] - ray.available_resources().get("CPU", 0.0)


def _expected_texts(model: str) -> tuple[str, str]:
    """The greedy continuations of PROMPT and of MESSAGES (through the chat template), in this
    process."""
    from tokenwise import LLM, SamplingParams

    llm = LLM(model, **ENGINE)
    try:
        tok = llm.get_tokenizer()
        text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
        chat_ids = tok.encode(text, add_special_tokens=False)  # the template writes its BOS
        greedy = SamplingParams(temperature=0.0, max_tokens=8)
        out = llm.generate([PROMPT, {"prompt_token_ids": chat_ids}], greedy, use_tqdm=False)
        return out[0].outputs[0].text, out[1].outputs[0].text
    finally:
        llm.shutdown()


def test_misspelled_or_proxy_options_fail_before_any_replica() -> None:
    with pytest.raises(ValueError, match="unknown option 'max_len'"):
        build_openai_app({"llm_configs": [_config(max_len=8)]})
    with pytest.raises(ValueError, match=r"engine_kwargs\['port'\]: not a replica option"):
        build_openai_app(_config(port=8000))
    with pytest.raises(ValueError, match="exactly one model per application"):
        build_openai_app({"llm_configs": [_config(), _config()]})
    with pytest.raises(ValueError, match="needs a 'model_id' string"):
        LLMConfig(model_loading_config={"model_source": "default"})


@pytest.mark.timeout(240, method="thread")
def test_a_replica_serves_chat_completions_and_shutdown_leaves_no_actor() -> None:
    model = checkpoint()  # the tiny Llama the engine tests share (built once per process)
    expected, expected_chat = _expected_texts(model)
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = build_openai_app({"llm_configs": [_config(model)]})
        serve.run(app, name="tw", route_prefix="/")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        assert [m.id for m in client.models.list().data] == [MODEL_ID]
        reply = client.chat.completions.create(
            model=MODEL_ID, messages=MESSAGES, max_tokens=8, temperature=0.0, timeout=60
        )
        assert reply.model == MODEL_ID and reply.choices[0].message.role == "assistant"
        assert reply.choices[0].message.content == expected_chat
        completion = client.completions.create(
            model=MODEL_ID, prompt=PROMPT, max_tokens=8, temperature=0.0, timeout=60
        )
        assert completion.choices[0].text == expected
        assert _reserved_cpus() == 1.0  # the replica's
        serve.shutdown()
        deadline = time.monotonic() + 30
        while ray.util.list_named_actors(all_namespaces=True) or _reserved_cpus():
            assert time.monotonic() < deadline, ray.util.list_named_actors(all_namespaces=True)
            time.sleep(0.2)
    finally:
        ray.shutdown()
