"""A soak test: 300 mixed requests against one `tokenwise serve` whose KV pool forces preemption.

Why it exists: the other server tests exercise one feature at a time on an idle engine. Real
traffic mixes them while the scheduler is preempting: streamed and plain responses of both
endpoints, several choices per request, stop strings, logprobs, and clients that time out,
close a stream early or cancel their task. Bugs that live in those interactions (a choice lost
or duplicated by recomputation, a block leaked when an abort races a finish, an error event
under load, a server left busy or unhealthy) show up only in a run like this one.

The pool is the smallest the engine accepts (8 blocks of 16 tokens for a 128-token model
length), so a handful of running sequences exhausts it. The mix comes from a seeded
`random.Random`, so every run sends the same requests (their timing, as any real load's,
varies).

What it promises:
- every request whose client waited for the answer gets a 200 (no 5xx at all) with one choice
  per `n`, each finished with "stop" or "length"; a text never contains a stop string (unless
  the request asked to include it, and then only at its end); token counts from usage and from
  logprobs agree and stay within `n * max_tokens`; logprobs have the requested shape; streams
  end with `data: [DONE]` after a finishing chunk for every choice;
- greedy requests for one prompt return the text the idle server returned for it, whatever
  was preempted and recomputed in between;
- afterwards the server drains (nothing runs or waits, no KV block is held) within 30 s; it
  really preempted, really aborted abandoned requests, and its finish counters account for
  every sequence it was sent; `/health` is 200 and a plain request still succeeds.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import re
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.entrypoints._server import RemoteServer, metric_value, wait_for_idle
from tests.tiny_checkpoints import build_tiny_checkpoint

NAME = "tiny-soak"
MAX_MODEL_LEN = 128
SERVER_ARGS = (
    "--served-model-name",
    NAME,
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--block-size",
    "16",
    "--num-gpu-blocks",
    "8",  # 8 * 16 = 128 slots: the smallest pool that holds one max-model-len sequence
    "--max-num-seqs",
    "16",
    "--max-num-batched-tokens",
    "64",
)
SEED = 20240917
NUM_REQUESTS = 300
CONCURRENCY = 24
MAX_TOKENS = 24
REQUEST_TIMEOUT_S = 60.0  # per connect / read / write of one client call
SOAK_TIMEOUT_S = 150.0  # all 300 requests
FINISHED = {"stop", "length"}
# Short words of the tiny tokenizer's training text: 1-16 of them stay well under 64 tokens,
# so prompt + max_tokens never reaches MAX_MODEL_LEN and "length" always means max_tokens.
WORDS = (
    "the quick brown fox jumps over lazy dog hello world tiny model cat sat on mat bird "
    "tree paged attention blocks memory batching requests step token next once upon time"
).split()
# Common letters and pairs of the tiny model's output, so that most stop strings do fire.
STOPS = ("e", "r", " ", "o", "at", "he", " t")
CANARY = {"prompt": "Once upon a time the tiny model", "max_tokens": 16, "temperature": 0.0}

COMPLETE, TIMEOUT, CLOSE, CANCEL = "complete", "timeout", "close", "cancel"


@dataclass
class Plan:
    """One request of the mix, drawn up front so the mix does not depend on timing."""

    index: int
    chat: bool
    stream: bool
    n: int
    max_tokens: int
    fate: str  # COMPLETE, or how the client leaves: TIMEOUT, CLOSE (a stream) or CANCEL
    body: dict[str, Any]
    stops: list[str] = field(default_factory=list)
    include_stop: bool = False
    logprobs: int | None = None  # k of completions' `logprobs` / chat's `top_logprobs`
    canary: bool = False
    leave_after_s: float = 0.0  # TIMEOUT: the read timeout; CANCEL: delay after sending
    leave_after_chunks: int = 0  # CLOSE: data chunks read before closing

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"

    def describe(self) -> str:
        keys = ("stream", "n", "max_tokens", "stop", "include_stop_str_in_output", "logprobs")
        shown = {k: self.body[k] for k in keys if k in self.body}
        return f"#{self.index} {self.path} {self.fate} {shown}"


@dataclass
class Outcome:
    """What the client saw of one request."""

    plan: Plan
    sent: asyncio.Event = field(default_factory=asyncio.Event)  # body fully written
    status: int | None = None  # set once response headers arrived
    left: str | None = None  # why the client deliberately stopped reading, if it did
    error: str | None = None  # an unexpected client-side exception
    body: Any = None  # the parsed JSON of a non-streamed response
    chunks: list[dict[str, Any]] = field(default_factory=list)  # parsed SSE data events
    lines_after_done: int = 0
    saw_done: bool = False


@dataclass
class Choice:
    """One choice as assembled from a response or from its stream."""

    text: str = ""
    finish: str | None = None
    stop_reason: Any = None
    tokens: int = 0  # counted from logprobs
    token_texts: list[str] = field(default_factory=list)  # completions' logprobs.tokens
    text_offsets: list[int] = field(default_factory=list)  # completions' logprobs.text_offset
    after_finish: int = 0  # stream chunks that came after its finishing chunk


def make_plan(rng: random.Random, index: int) -> Plan:
    roll = rng.random()
    fate = COMPLETE if roll < 0.72 else TIMEOUT if roll < 0.80 else CLOSE if roll < 0.88 else CANCEL
    stream = fate == CLOSE or (fate != TIMEOUT and rng.random() < 0.5)
    n = rng.choice((1, 1, 2, 3))
    canary = fate == COMPLETE and rng.random() < 0.1
    chat = not canary and rng.random() < 0.5
    # Abandoned requests ask for more tokens, so they are usually still running when left.
    max_tokens = rng.randint(1, MAX_TOKENS) if fate == COMPLETE else rng.randint(12, MAX_TOKENS)
    body: dict[str, Any] = {"model": NAME, "n": n, "stream": stream}
    if stream and rng.random() < 0.7:
        body["stream_options"] = {"include_usage": True}
    plan = Plan(index, chat, stream, n, max_tokens, fate, body, canary=canary)
    if canary:
        plan.max_tokens = CANARY["max_tokens"]
        body.update(CANARY, ignore_eos=True)
    else:
        body["max_tokens"] = max_tokens
        body["temperature"] = rng.choice((0.0, 0.7, 1.0))
        body["ignore_eos"] = rng.random() < 0.5
        if rng.random() < 0.5:
            body["seed"] = rng.randint(0, 1000)
        words = " ".join(rng.choices(WORDS, k=rng.randint(1, 16)))
        if chat:
            messages = [{"role": "user", "content": words}]
            if rng.random() < 0.3:
                messages.insert(0, {"role": "system", "content": "Be brief."})
            body["messages"] = messages
        else:
            body["prompt"] = f"{index}: {words}"
        if rng.random() < 0.4:
            plan.stops = rng.sample(STOPS, rng.randint(1, 2))
            plan.include_stop = rng.random() < 0.25
            body["stop"] = plan.stops
            body["include_stop_str_in_output"] = plan.include_stop
    if rng.random() < 0.35:
        plan.logprobs = rng.randint(0, 4)
        if chat:
            body.update(logprobs=True, top_logprobs=plan.logprobs)
        else:
            body["logprobs"] = plan.logprobs
    if fate == TIMEOUT:
        plan.leave_after_s = rng.uniform(0.05, 0.5)
    elif fate == CANCEL:
        plan.leave_after_s = rng.uniform(0.0, 0.5)
    elif fate == CLOSE:
        plan.leave_after_chunks = rng.randint(1, 2)
    return plan


# ---- the clients ----------------------------------------------------------------------------


async def send(client: httpx.AsyncClient, outcome: Outcome) -> None:
    """Send the request and read the response, leaving early as the plan says."""
    plan = outcome.plan

    async def trace(event: str, info: dict[str, Any]) -> None:
        if event == "http11.send_request_body.complete":
            outcome.sent.set()

    read = plan.leave_after_s if plan.fate == TIMEOUT else REQUEST_TIMEOUT_S
    kwargs: dict[str, Any] = {
        "json": plan.body,
        "timeout": httpx.Timeout(REQUEST_TIMEOUT_S, read=read),
        "extensions": {"trace": trace},
    }
    if not plan.stream:
        try:
            response = await client.post(plan.path, **kwargs)
        except httpx.ReadTimeout:
            if plan.fate != TIMEOUT:
                raise
            outcome.left = "read timeout"
            return
        outcome.status = response.status_code
        outcome.body = response.json()
        return
    async with client.stream("POST", plan.path, **kwargs) as response:
        outcome.status = response.status_code
        if response.status_code != 200:
            outcome.body = json.loads(await response.aread())
            return
        async for line in response.aiter_lines():
            if not line:
                continue
            if outcome.saw_done:
                outcome.lines_after_done += 1
            elif line == "data: [DONE]":
                outcome.saw_done = True
            else:
                outcome.chunks.append(json.loads(line.removeprefix("data: ")))
                if plan.fate == CLOSE and len(outcome.chunks) >= plan.leave_after_chunks:
                    outcome.left = f"closed after {len(outcome.chunks)} chunks"
                    return  # leaving the block closes the connection mid-stream


async def run_one(client: httpx.AsyncClient, plan: Plan, slots: asyncio.Semaphore) -> Outcome:
    outcome = Outcome(plan)
    async with slots:
        task = asyncio.ensure_future(send(client, outcome))
        if plan.fate == CANCEL:
            # Cancel only once the request is on the wire: then it is an abort of an
            # in-flight request, not a request that was never made.
            sent = asyncio.ensure_future(outcome.sent.wait())
            await asyncio.wait({task, sent}, return_when=asyncio.FIRST_COMPLETED)
            sent.cancel()
            if not task.done():
                await asyncio.sleep(plan.leave_after_s)
                task.cancel()
        await asyncio.wait({task})
    if task.cancelled():
        outcome.left = "cancelled"
    elif task.exception() is not None:
        outcome.error = repr(task.exception())
    return outcome


async def run_mix(base_url: str, plans: list[Plan]) -> list[Outcome]:
    # No keep-alive: a pooled connection that uvicorn closes as idle just as a client reuses
    # it fails with a ReadError on the client's side, a race of the test, not of the server.
    limits = httpx.Limits(max_connections=CONCURRENCY + 8, max_keepalive_connections=0)
    slots = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(base_url=base_url, limits=limits) as client:
        work = asyncio.gather(*(run_one(client, plan, slots) for plan in plans))
        return await asyncio.wait_for(work, SOAK_TIMEOUT_S)


# ---- checking one outcome -------------------------------------------------------------------


def logprob_problems(plan: Plan, logprobs: Any, has_text: bool) -> tuple[int, list[str]]:
    """The number of tokens `logprobs` covers, and what is wrong with its shape. A chat stream
    chunk without new tokens (the opening role chunk, say) has none; whether every token got
    one is checked against usage."""
    if plan.logprobs is None:
        return 0, [] if logprobs is None else [f"unrequested logprobs {logprobs}"]
    if logprobs is None:
        no_tokens_ok = plan.chat and plan.stream and not has_text
        return 0, [] if no_tokens_ok else ["logprobs missing"]
    k = plan.logprobs
    problems = []
    if plan.chat:
        content = logprobs["content"] or []
        for token in content:
            tops = [t["logprob"] for t in token["top_logprobs"]]
            if len(tops) != k or tops != sorted(tops, reverse=True) or token["logprob"] > 0:
                problems.append(f"bad chat logprob (top_logprobs={k}): {token}")
        return len(content), problems
    tokens = logprobs["tokens"]
    lists = ("token_logprobs", "top_logprobs", "text_offset")
    if any(len(logprobs[name]) != len(tokens) for name in lists):
        problems.append(f"completion logprob lists differ in length: {logprobs}")
    for token, top in zip(tokens, logprobs["top_logprobs"], strict=False):
        # The k most likely plus the sampled token, keyed by text.
        if not 1 <= len(top) <= k + 1 or token not in top:
            problems.append(f"bad top_logprobs (logprobs={k}) for {token!r}: {top}")
    return len(tokens), problems


def assemble(outcome: Outcome) -> tuple[dict[int, Choice], dict[str, Any] | None, list[str]]:
    """The choices and usage of a finished response, and what is wrong with its framing."""
    plan = outcome.plan
    choices: dict[int, Choice] = {}
    problems: list[str] = []

    def add(raw: dict[str, Any]) -> None:
        choice = choices.setdefault(raw["index"], Choice())
        if choice.finish is not None:
            choice.after_finish += 1
        if plan.chat and plan.stream:
            text = raw["delta"].get("content") or ""
        elif plan.chat:
            text = raw["message"]["content"] or ""
        else:
            text = raw["text"]
        choice.text += text
        logprobs = raw.get("logprobs")
        tokens, bad = logprob_problems(plan, logprobs, has_text=bool(text))
        choice.tokens += tokens
        if logprobs is not None and not plan.chat:
            choice.token_texts += logprobs["tokens"]
            choice.text_offsets += logprobs["text_offset"]
        problems.extend(bad)
        choice.finish = raw["finish_reason"] or choice.finish
        choice.stop_reason = raw.get("stop_reason") or choice.stop_reason

    if not plan.stream:
        for raw in outcome.body["choices"]:
            add(raw)
        return choices, outcome.body.get("usage"), problems
    if not outcome.saw_done or outcome.lines_after_done:
        problems.append(f"stream did not end with one data: [DONE] ({outcome.lines_after_done})")
    chunks = list(outcome.chunks)
    usage = None
    if chunks and not chunks[-1].get("choices") and chunks[-1].get("usage") is not None:
        usage = chunks.pop()["usage"]
    if ("stream_options" in plan.body) != (usage is not None):
        problems.append(f"usage chunk {'missing' if usage is None else 'unrequested'}")
    if plan.chat:
        roles = [c["delta"].get("role") for c in chunks[0]["choices"]] if chunks else []
        if roles != ["assistant"] * plan.n:
            problems.append(f"first chat chunk does not open every choice: {chunks[:1]}")
    for chunk in chunks:
        if "error" in chunk or not chunk.get("choices"):
            problems.append(f"unexpected event: {chunk}")
            continue
        for raw in chunk["choices"]:
            add(raw)
    return choices, usage, problems


def choice_problems(plan: Plan, choice: Choice) -> list[str]:
    problems = []
    if choice.finish not in FINISHED:
        problems.append(f"finish_reason {choice.finish!r}")
    if choice.after_finish:
        problems.append(f"{choice.after_finish} chunks after the finishing one")
    if plan.logprobs is not None:
        if choice.tokens > plan.max_tokens:
            problems.append(f"{choice.tokens} tokens > max_tokens")
        if choice.finish == "length" and choice.tokens != plan.max_tokens:
            problems.append(f"finished by length after {choice.tokens} tokens")
    # Each token's offset is where it starts, counting on from chunk to chunk in a stream.
    starts = list(itertools.accumulate((len(t) for t in choice.token_texts[:-1]), initial=0))
    if choice.text_offsets != starts[: len(choice.token_texts)]:
        problems.append(f"text_offset {choice.text_offsets} for tokens {choice.token_texts}")
    text = choice.text
    if plan.include_stop and choice.finish == "stop" and isinstance(choice.stop_reason, str):
        if not text.endswith(choice.stop_reason):
            problems.append(f"text {text!r} does not end with {choice.stop_reason!r}")
        text = text[: len(text) - len(choice.stop_reason)]
    elif plan.include_stop and choice.finish == "stop":  # chat streams carry no stop_reason
        text = next((text[: -len(s)] for s in plan.stops if text.endswith(s)), text)
    for stop in plan.stops:
        if stop in text:
            problems.append(f"stop string {stop!r} inside {choice.text!r}")
    return problems


def outcome_problems(outcome: Outcome, canary_text: str) -> list[str]:
    """Everything wrong with one request, each line naming it."""
    plan = outcome.plan
    where = plan.describe()
    if outcome.error is not None:
        return [f"{where}: client error {outcome.error}"]
    if outcome.status is not None and outcome.status != 200:
        return [f"{where}: HTTP {outcome.status} {outcome.body}"]
    if outcome.left is not None:
        return [] if plan.fate != COMPLETE else [f"{where}: left ({outcome.left})"]
    choices, usage, problems = assemble(outcome)
    if sorted(choices) != list(range(plan.n)):
        problems.append(f"choice indices {sorted(choices)}")
    for index, choice in sorted(choices.items()):
        problems.extend(f"choice {index}: {p}" for p in choice_problems(plan, choice))
        if plan.canary and choice.text != canary_text:
            problems.append(f"greedy choice {index} {choice.text!r} != idle {canary_text!r}")
    if usage is not None:
        completion = usage["completion_tokens"]
        if completion > plan.n * plan.max_tokens:
            problems.append(f"usage {usage} over n * max_tokens")
        if all(c.finish == "length" for c in choices.values()) and completion != (
            plan.n * plan.max_tokens
        ):
            problems.append(f"usage {usage} though every choice ran to max_tokens")
        if plan.logprobs is not None and completion != sum(c.tokens for c in choices.values()):
            problems.append(f"usage {usage} != tokens with logprobs")
        if usage["total_tokens"] != usage["prompt_tokens"] + completion:
            problems.append(f"usage {usage} does not add up")
        if usage["prompt_tokens"] + plan.max_tokens >= MAX_MODEL_LEN:
            problems.append(f"the plan's prompt is too long for this test: {usage}")
    return [f"{where}: {p}" for p in problems]


# ---- the test -------------------------------------------------------------------------------


def finished_by_reason(metrics: str) -> dict[str, float]:
    """`tokenwise:request_success_total` per finished_reason label."""
    return {
        reason: metric_value(metrics, "tokenwise:request_success_total", finished_reason=reason)
        for reason in re.findall(
            r'^tokenwise:request_success_total\{[^}]*finished_reason="(\w+)"', metrics, re.M
        )
    }


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    model_dir = build_tiny_checkpoint(tmp_path_factory.mktemp("soak"))
    # One torch thread in the server too, as tests/conftest.py sets for the test process: with
    # two threads on a busy 2-core machine this soak was measured 12x slower (94 s, not 7.5 s).
    with RemoteServer(model_dir, *SERVER_ARGS, env={"OMP_NUM_THREADS": "1"}) as srv:
        yield srv


def post(server: RemoteServer, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(server.url("/v1/completions"), json=body, timeout=REQUEST_TIMEOUT_S)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.timeout(400)
def test_soak_mixed_requests_under_preemption(server: RemoteServer) -> None:
    rng = random.Random(SEED)
    plans = [make_plan(rng, i) for i in range(NUM_REQUESTS)]
    canary = post(server, {"model": NAME, **CANARY, "ignore_eos": True})["choices"][0]["text"]
    before = wait_for_idle(server)

    outcomes = asyncio.run(run_mix(server.base_url, plans))

    problems = [p for outcome in outcomes for p in outcome_problems(outcome, canary_text=canary)]
    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems[:30])
    left = [o for o in outcomes if o.left is not None]
    ways_left = {o.plan.fate for o in left}
    assert ways_left == {TIMEOUT, CLOSE, CANCEL}, f"clients left only by {ways_left}"

    after = wait_for_idle(server, timeout=30.0)  # fails unless all blocks come back

    def delta(name: str, **labels: str) -> float:
        return metric_value(after, name, **labels) - metric_value(before, name, **labels)

    assert delta("tokenwise:num_preemptions_total") > 0, "the small pool never preempted"
    finished_before, finished_after = finished_by_reason(before), finished_by_reason(after)
    finished = {r: v - finished_before.get(r, 0.0) for r, v in finished_after.items()}
    assert set(finished) <= FINISHED | {"abort"}, finished
    # A request whose client left may have been dropped before its handler read it, so the
    # counters can only be bracketed: every sequence of a request the server answered (headers
    # sent) finished once, plus at most every sequence of a sent request that it did not answer.
    answered = sum(o.plan.n for o in outcomes if o.status is not None)
    unanswered = sum(o.plan.n for o in outcomes if o.status is None and o.sent.is_set())
    total = sum(finished.values())
    assert answered <= total <= answered + unanswered, (finished, answered, unanswered)
    waited_for = sum(o.plan.n for o in outcomes if o.left is None)
    assert finished.get("stop", 0) + finished.get("length", 0) >= waited_for, finished
    abandoned = sum(o.plan.n for o in left)
    assert 0 < finished.get("abort", 0) <= abandoned, (finished, abandoned)

    assert httpx.get(server.url("/health"), timeout=10.0).status_code == 200
    last = post(server, {"model": NAME, "prompt": "Still serving?", "max_tokens": 4})
    assert last["choices"][0]["finish_reason"] in FINISHED
