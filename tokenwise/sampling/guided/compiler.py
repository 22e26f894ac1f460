"""Compile guided-decoding grammars once per distinct spec, on a thread, off the step's path.

Compiling a grammar against a vocabulary (xgrammar precomputes which tokens each grammar state
allows) takes from milliseconds to seconds, far longer than a decode step. So `submit` returns
at once with a `Future`: the work runs on a small thread pool (xgrammar releases the GIL while
it compiles), the scheduler leaves the request waiting until its future is done, and the engine
keeps stepping everyone else meanwhile.

Compiled grammars are cached by the spec's canonical key (`GuidedDecodingParams.cache_key`):
the n samples of a request, and every later request with the same schema, share one compile
(and one `Future`, so a second request for a grammar still compiling waits for the first
compile rather than starting another). The cache keeps the most recently used
`max_cached_grammars` specs.

The xgrammar compiler itself (and the tokenizer's `TokenizerInfo`, which walks the whole
vocabulary) is built on the pool's thread at the first guided request, so engines that never
see one pay nothing.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import xgrammar

from tokenwise import envs
from tokenwise.sampling.guided.grammar import build_grammar
from tokenwise.sampling.guided.params import GuidedDecodingParams

# A grammar not compiled within this many seconds fails its request (see `GrammarState.poll`).
GRAMMAR_COMPILE_TIMEOUT_ENV = "TOKENWISE_GRAMMAR_COMPILE_TIMEOUT_S"
DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S = 30.0


def grammar_compile_timeout_s() -> float:
    """The compile timeout from the environment (seconds, > 0), else the default."""
    raw = envs.get(GRAMMAR_COMPILE_TIMEOUT_ENV)
    if raw is None or raw == "":
        return DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{GRAMMAR_COMPILE_TIMEOUT_ENV} must be a number > 0, got {raw!r}")
    return value


class GrammarCompileCache:
    """`submit(spec)` -> `Future[xgrammar.CompiledGrammar]`, one compile per distinct spec."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        max_workers: int = 2,
        max_cached_grammars: int = 256,
        compiler_threads: int | None = None,
    ) -> None:
        # `vocab_size` is the model's (the logits' width), which may exceed the tokenizer's:
        # xgrammar then never allows the padding ids.
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compiler_threads = compiler_threads or min(4, os.cpu_count() or 1)
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers, thread_name_prefix="tokenwise-grammar")
        self._futures: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._lock = threading.Lock()
        self.max_cached_grammars = max_cached_grammars
        self.num_compiles = 0  # how many compiles were started (tests read it)

    def submit(self, spec: GuidedDecodingParams) -> Future:
        key = spec.cache_key()
        with self._lock:
            future = self._futures.get(key)
            if future is not None and not (future.done() and future.exception() is not None):
                self._futures.move_to_end(key)
                return future
            future = self._executor.submit(self._compile, spec)
            self.num_compiles += 1
            self._futures[key] = future
            while len(self._futures) > self.max_cached_grammars:
                self._futures.popitem(last=False)
            return future

    def _compile(self, spec: GuidedDecodingParams) -> xgrammar.CompiledGrammar:
        return self._get_compiler().compile_grammar(build_grammar(spec))

    def _get_compiler(self) -> xgrammar.GrammarCompiler:
        with self._compiler_lock:
            if self._compiler is None:
                info = xgrammar.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size
                )
                self._compiler = xgrammar.GrammarCompiler(
                    info, max_threads=self._compiler_threads, cache_enabled=False
                )
            return self._compiler

    def shutdown(self) -> None:
        """Stop taking work; a compile under way finishes on its thread (it cannot be cut)."""
        self._executor.shutdown(wait=False, cancel_futures=True)
