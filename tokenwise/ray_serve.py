"""Ray Serve: the OpenAI server's routes from replicas, one engine per replica.

Named as vLLM's Ray Serve LLM API is (`ray.serve.llm`), so a deployment script ports over by
changing the import::

    from ray import serve
    from tokenwise.ray_serve import LLMConfig, build_openai_app

    config = LLMConfig(
        model_loading_config={"model_id": "my-model", "model_source": "/models/my-model"},
        engine_kwargs={"dtype": "bfloat16", "max_model_len": 4096},
        deployment_config={"autoscaling_config": {"min_replicas": 1, "max_replicas": 4}},
    )
    serve.run(build_openai_app({"llm_configs": [config]}))

Each replica runs exactly what `tokenwise serve` runs short of uvicorn (`build_server`): the
same flags (`engine_kwargs` are its options, spelled as keywords), the same app, routes and
API key; Ray Serve's proxy takes the HTTP connections and spreads them over the replicas, and
restarts a replica whose engine died (its `check_health` fails). One model per application:
vLLM's router across several models is not built.

Ray (with its `serve` extra) is optional: `pip install tokenwise[ray]`. It is imported when an
application is built, so importing this module needs no Ray.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

#: `tokenwise serve` options that make no sense inside a replica: Ray Serve's proxy listens
#: (set its host and port with `serve.start(http_options=...)`), and a replica is no headless
#: data-parallel host.
_NOT_REPLICA_OPTIONS = {
    "host": "Ray Serve's proxy listens: serve.start(http_options={'host': ...})",
    "port": "Ray Serve's proxy listens: serve.start(http_options={'port': ...})",
    "headless": "a replica serves HTTP; run headless hosts with `tokenwise serve --headless`",
    "model": "give the model as model_loading_config['model_source']",
    "model_tag": "give the model as model_loading_config['model_source']",
    "served_model_name": "give the name as model_loading_config['model_id']",
}
_INTERNAL = {"command", "func", "log_level"}


@dataclass
class LLMConfig:
    """One model's application (vLLM's `LLMConfig` fields that tokenwise honours).

    `model_loading_config`: `model_id` (the name clients send as `model`) and optional
    `model_source` (a checkpoint directory or GGUF file; default: `model_id`, and `"default"`
    is the built-in model). `engine_kwargs`: `tokenwise serve` options as keywords
    (`{"dtype": "float32", "api_key": "..."}`). `deployment_config`: Ray Serve deployment
    options (`num_replicas`, `autoscaling_config`, `max_ongoing_requests`,
    `ray_actor_options`, ...), passed to `Deployment.options` unchanged.
    """

    model_loading_config: dict[str, Any]
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    deployment_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        loading = self.model_loading_config
        if not isinstance(loading, dict) or not isinstance(loading.get("model_id"), str):
            raise ValueError(
                "LLMConfig.model_loading_config needs a 'model_id' string (the served model "
                f"name), got {loading!r}"
            )
        unknown = sorted(set(loading) - {"model_id", "model_source"})
        if unknown:
            raise ValueError(
                f"LLMConfig.model_loading_config has unknown key(s) {', '.join(unknown)}; "
                "known: model_id, model_source"
            )
        for name in ("engine_kwargs", "deployment_config"):
            if not isinstance(getattr(self, name), dict):
                raise ValueError(f"LLMConfig.{name} must be a dict, got {getattr(self, name)!r}")

    @property
    def model_id(self) -> str:
        return self.model_loading_config["model_id"]

    def server_args(self) -> dict[str, Any]:
        """The `tokenwise serve` options of each replica, checked here (on the driver), so a
        misspelled option fails `build_openai_app` instead of every replica's start."""
        from tokenwise.entrypoints.cli import build_parser

        args = vars(build_parser().parse_args(["serve"]))
        for key, value in self.engine_kwargs.items():
            if key in _NOT_REPLICA_OPTIONS:
                raise ValueError(
                    f"LLMConfig.engine_kwargs[{key!r}]: not a replica option ({_NOT_REPLICA_OPTIONS[key]})"
                )
            if key not in args or key in _INTERNAL:
                raise ValueError(
                    f"LLMConfig.engine_kwargs has unknown option {key!r}: use the names of "
                    "`tokenwise serve --help` with '_' for '-' (e.g. max_model_len)"
                )
            args[key] = value
        args["model"] = self.model_loading_config.get("model_source", self.model_id)
        args["served_model_name"] = self.model_id
        for key in _INTERNAL:
            args.pop(key, None)
        return args


def _as_config(value: LLMConfig | dict[str, Any]) -> LLMConfig:
    if isinstance(value, LLMConfig):
        return value
    if isinstance(value, dict):
        return LLMConfig(**value)
    raise ValueError(f"an LLM config must be an LLMConfig or a dict, got {type(value).__name__}")


def build_openai_app(llm_serving_args: dict[str, Any] | LLMConfig) -> Any:
    """A Ray Serve application serving the OpenAI routes for one model (vLLM's name and
    argument: `{"llm_configs": [config]}`, a config being an `LLMConfig` or its dict); run
    it with `serve.run(app)`."""
    if isinstance(llm_serving_args, dict) and "llm_configs" in llm_serving_args:
        configs = llm_serving_args["llm_configs"]
        extra = sorted(set(llm_serving_args) - {"llm_configs"})
        if extra:
            raise ValueError(f"build_openai_app: unknown key(s) {', '.join(extra)}")
    else:
        configs = [llm_serving_args]
    if not isinstance(configs, list) or len(configs) != 1:
        raise ValueError(
            "build_openai_app serves exactly one model per application (llm_configs with one "
            f"entry); got {configs!r}. Run one application per model"
        )
    config = _as_config(configs[0])
    args = config.server_args()
    try:
        from ray import serve
    except ImportError as exc:
        raise ImportError(
            f"tokenwise.ray_serve needs Ray Serve: pip install 'tokenwise[ray]' ({exc})"
        ) from None
    deployment = serve.deployment(name="LLMServer")(serve.ingress()(LLMServer))
    return deployment.options(**config.deployment_config).bind(args)


class LLMServer:
    """One replica: an engine and the server's app around it (`serve.ingress` builds the
    replica's ASGI app from `__serve_build_asgi_app__` once the engine is up; the app's
    lifespan starts and stops the engine's loop)."""

    def __init__(self, server_args: dict[str, Any]) -> None:
        from tokenwise.entrypoints.openai.api_server import build_server

        self._died_of: BaseException | None = None
        self._engine, self._async_engine, self._app, _ = build_server(
            argparse.Namespace(**server_args), self._dead
        )

    def _dead(self, exc: BaseException) -> None:
        self._died_of = exc

    def __serve_build_asgi_app__(self) -> Any:
        return self._app

    def check_health(self) -> None:
        """Ray Serve's periodic probe: a dead engine makes the replica unhealthy, and Serve
        replaces it (in-flight requests already got their errors)."""
        if self._died_of is not None or not self._async_engine.is_healthy:
            raise RuntimeError(f"the engine died: {self._died_of!r}")

    def __del__(self) -> None:
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine.shutdown()  # core processes too (the lifespan stopped the loop)


__all__ = ["LLMConfig", "LLMServer", "build_openai_app"]
