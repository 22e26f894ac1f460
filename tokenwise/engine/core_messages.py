"""The messages between an engine-core process and its client, and their wire format.

Client to core: `AddRequest` (with the request's scheduling `priority`), `AbortRequests`,
`StopCore`. Core to client: `CoreReady`, then one `CoreOutputs` per step (its outputs,
statistics and step record), `CoreRejected` for a request the core could not take, `CoreDead`
when the core fails. On a separate request-reply socket the client asks `CheckLoRA` and the
core answers `LoRAChecked` (a server loading an adapter at run time). A core on another host
first says `CoreHello` on the front end's RPC port and is answered `Welcome` (where its request
and output sockets are, the DP rendezvous port), or refused (`Welcome.error`). Each is a tagged msgspec
struct sent as one ZeroMQ
frame of msgpack: the per-step outputs, the hot path, decode straight into the engine's own
`RequestOutput` dataclasses without pickle. What is polymorphic and travels once per request
(the prompt, the sampling parameters with their guided-decoding spec, a LoRA request) is pickled
inside `AddRequest.payload`: both ends are this package, and the client validated it already.

The outputs leave out the prompt (text and token ids): the client kept both when it validated
the request and puts them back, so a long prompt is not sent again with every token.
"""

from __future__ import annotations

import pickle
from typing import Any

import msgspec

from tokenwise.engine.stats import EngineStats
from tokenwise.engine.step_records import StepRecord
from tokenwise.outputs import EmbeddingRequestOutput, RequestOutput


class AddRequest(msgspec.Struct, tag=True):
    request_id: str
    payload: bytes  # pickle of (prompt, params, cache_salt, lora_request)
    priority: int = 0


class AbortRequests(msgspec.Struct, tag=True):
    request_ids: list[str]


class StopCore(msgspec.Struct, tag=True):
    pass


class CoreReady(msgspec.Struct, tag=True):
    rank: int
    num_blocks: int
    # The model kind's `prompt_settings` (a vision-language model's placeholder token and
    # image sizes): the client processes prompts with them.
    prompt_settings: dict[str, int] = {}


class CoreOutputs(msgspec.Struct, tag=True):
    rank: int
    outputs: list[RequestOutput]
    stats: EngineStats
    # batch size -> (forward passes, median ms): sent at most once a second, and None between.
    forward_times: dict[int, tuple[int, float]] | None = None
    embeddings: list[EmbeddingRequestOutput] = []
    # The step records since the previous message (`step_records`; usually this step's one),
    # and each KV block's state, sent with the forward times (at most once a second).
    steps: list[StepRecord] = []
    kv_blocks: bytes | None = None


class CoreRejected(msgspec.Struct, tag=True):
    rank: int
    request_id: str
    message: str


class CoreDead(msgspec.Struct, tag=True):
    rank: int
    message: str
    error_type: str = ""  # the exception's class name ("ValueError": a configuration error)


class CheckLoRA(msgspec.Struct, tag=True):
    """A question on the control socket: does this adapter load and fit the model?"""

    payload: bytes  # pickle of the LoRARequest


class LoRAChecked(msgspec.Struct, tag=True):
    error: str | None  # why the adapter is refused, None when it fits


class ControlCall(msgspec.Struct, tag=True):
    """A question on the control socket: run one of the engine's `SleepControl` calls
    (`engine/sleep_control.py`: sleep, wake_up, pause, weight updates) between two steps."""

    method: str
    payload: bytes  # pickle of the positional arguments


class ControlDone(msgspec.Struct, tag=True):
    error: str | None  # "ErrorType: message" when the call raised
    payload: bytes  # pickle of (result, the control's state afterwards)


class CoreHello(msgspec.Struct, tag=True):
    """A remote core's first words: who it is, so the front end can name it if it is lost."""

    rank: int
    data_parallel_size: int
    host: str
    pid: int
    model: str  # `model_signature`: both ends must serve the same model


class Welcome(msgspec.Struct, tag=True):
    input_address: str = ""
    output_address: str = ""
    master_port: int = 0
    error: str | None = None  # why the front end refuses this core (then nothing else is set)


ToCore = AddRequest | AbortRequests | StopCore | CheckLoRA | ControlCall
FromCore = CoreReady | CoreOutputs | CoreRejected | CoreDead | LoRAChecked | ControlDone

_encoder = msgspec.msgpack.Encoder()
_to_core = msgspec.msgpack.Decoder(ToCore)
_from_core = msgspec.msgpack.Decoder(FromCore)
_hello = msgspec.msgpack.Decoder(CoreHello)
_welcome = msgspec.msgpack.Decoder(Welcome)


def encode(message: ToCore | FromCore | CoreHello | Welcome) -> bytes:
    return _encoder.encode(message)


def decode_to_core(frame: bytes) -> ToCore:
    return _to_core.decode(frame)


def decode_from_core(frame: bytes) -> FromCore:
    return _from_core.decode(frame)


def decode_hello(frame: bytes) -> CoreHello:
    return _hello.decode(frame)


def decode_welcome(frame: bytes) -> Welcome:
    return _welcome.decode(frame)


def add_request(
    request_id: str,
    prompt: Any,
    params: Any,
    cache_salt: str | None,
    lora_request: Any,
    priority: int = 0,
) -> AddRequest:
    payload = pickle.dumps((prompt, params, cache_salt, lora_request), pickle.HIGHEST_PROTOCOL)
    return AddRequest(request_id, payload, priority)


def add_request_fields(message: AddRequest) -> tuple[Any, Any, str | None, Any]:
    """(prompt, params, cache_salt, lora_request) of an `AddRequest`."""
    return pickle.loads(message.payload)


def strip_prompts(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """The outputs without their prompts (the client puts them back): set on the step's own
    output objects, which nothing else holds, so the requests keep theirs."""
    for out in outputs:
        out.prompt = None
        out.prompt_token_ids = []
    return outputs
