"""What the server needs besides the engine: its name, its key, and the caps on a request.

The caps exist because one request must not be able to monopolise (or crash) a shared server:
`n`, `logprobs` and the number of prompts in a batch multiply the work and the response size
of a single request, `max_tokens`
bounds how long it holds KV blocks, and the body limit bounds what is read into memory before
any validation runs. Each is a documented default, overridable by a `tokenwise serve` flag.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Any

from tokenwise.entrypoints.openai.reasoning import check_reasoning_parser
from tokenwise.entrypoints.openai.tool_parsers import check_tool_call_parser
from tokenwise.model_config import TASKS

DEFAULT_HOST = "127.0.0.1"  # loopback unless the operator explicitly exposes the server
DEFAULT_PORT = 8000
DEFAULT_MAX_N = 16  # completions per request (--max-n)
DEFAULT_MAX_PROMPTS = 64  # prompts in one batched /v1/completions request (--max-prompts)
DEFAULT_MAX_LOGPROBS = 20  # top logprobs per token (--max-logprobs); OpenAI's own cap
DEFAULT_MAX_REQUEST_BODY_BYTES = 1 << 20  # 1 MiB (--max-request-body-bytes) -> 413 above
DEFAULT_RESPONSES_STORE_SIZE = 1000  # kept for previous_response_id (--responses-store-size)

# Families whose replies only their own parsers can read, and which get them when the flags name
# none: gpt-oss always writes harmony (vLLM reads it so whatever its flags say); hermes or no
# reasoning parser would hand its special tokens' text to the client.
FAMILY_PARSERS: dict[str, dict[str, str]] = {
    "GptOssForCausalLM": {"reasoning_parser": "openai_gptoss", "tool_call_parser": "openai"},
}


def with_family_parsers(kwargs: dict[str, Any], architectures: list[str]) -> dict[str, Any]:
    """ServerConfig's `kwargs` with the model family's parsers (`FAMILY_PARSERS`) wherever
    they name none."""
    out = dict(kwargs)
    for arch in architectures:
        for key, name in FAMILY_PARSERS.get(arch, {}).items():
            if out.get(key) is None:
                out[key] = name
    return out


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str
    max_model_len: int
    api_key: str | None = None
    max_n: int = DEFAULT_MAX_N
    max_prompts: int = DEFAULT_MAX_PROMPTS
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    max_tokens_cap: int | None = None  # None: max_model_len (--max-tokens-cap)
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    # The engine's task: "generate" serves completions, "embed" /v1/embeddings, "score"
    # /v1/score and /v1/rerank, "classify" /v1/classify.
    task: str = "generate"
    # A speech model (Whisper) also serves /v1/audio/transcriptions.
    supports_audio: bool = False
    # A vision-language model's image placeholder (`<image>`); None: the model reads no images.
    image_token: str | None = None
    # Images one chat request may carry (--limit-mm-per-prompt '{"image": N}'); None: any.
    limit_images_per_prompt: int | None = None
    # Chat images may be local files under this directory (--allowed-local-media-path).
    allowed_local_media_path: str | None = None
    # Hosts chat image URLs may be fetched from (--allowed-media-domains); None: any host.
    allowed_media_domains: list[str] | None = None
    # Unknown request fields: False ignores them with a warning, True refuses them (400).
    strict_request_fields: bool = False
    # Splits chat replies' <think> part into reasoning_content (`reasoning`); None: off.
    reasoning_parser: str | None = None
    # Reads tool_choice "auto" replies' calls (`tool_parsers`); None: hermes.
    tool_call_parser: str | None = None
    # vLLM's --enable-auto-tool-choice: accepted, and it needs tool_call_parser.
    enable_auto_tool_choice: bool = False
    # One INFO line per HTTP request on tokenwise.server.access (`access_log`).
    access_log: bool = True
    # The web page at `/` and its data under `/ui/` (`serving_ui`; off: --disable-ui).
    ui: bool = True
    # The last N /v1/responses results kept in memory (`responses_store`); 0: none.
    responses_store_size: int = DEFAULT_RESPONSES_STORE_SIZE

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_n", "max_prompts", "max_request_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.responses_store_size < 0:
            raise ValueError(f"responses_store_size must be >= 0, got {self.responses_store_size}")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0, got {self.max_logprobs}")
        if self.max_tokens_cap is not None and self.max_tokens_cap < 1:
            raise ValueError(f"max_tokens_cap must be >= 1, got {self.max_tokens_cap}")
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        check_reasoning_parser(self.reasoning_parser)
        check_tool_call_parser(self.tool_call_parser, self.enable_auto_tool_choice)
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (omit --api-key to disable auth)")

    @property
    def effective_max_tokens_cap(self) -> int:
        return self.max_tokens_cap if self.max_tokens_cap is not None else self.max_model_len

    def key_matches(self, presented: str | None) -> bool:
        """Constant-time comparison, so response timing does not leak the key's prefix."""
        if self.api_key is None:
            return True
        if presented is None:
            return False
        return hmac.compare_digest(presented.encode(), self.api_key.encode())
