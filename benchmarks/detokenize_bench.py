"""Per-token detokenization time: the Python prefix window vs tokenizers' DecodeStream.

    python benchmarks/detokenize_bench.py [--tokens 400] [--rounds 7]

Both decoders are `IncrementalDetokenizer`'s (`use_decode_stream=False` / `True`), timed in one
process on two tokenizers: the built-in model's (`tokenwise/models_data/default`, byte-level
BPE, 4096 tokens) and the byte-level BPE the tests train (`tests/tiny_checkpoints.py`, 300
tokens, so multi-byte characters are mostly single-byte tokens). The "output" is a few hundred
tokens of text mixing ASCII, accented letters, CJK and emoji (many tokens complete no character
on their own). Per token, the work is what the engine does: `add_token`, then
`take_new_text(False)` (one output per step); the finished text is checked against
`tokenizer.decode` (minus a character the last token leaves incomplete), so both decoders are
timed doing the same, correct, work. Two cases: no stop strings, and two stop strings that never
occur (the search and hold-back still run).

Rounds alternate between the decoders (the machine is shared); each figure is the smallest of
the rounds' per-token means, the least disturbed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenwise.engine.detokenizer import IncrementalDetokenizer  # noqa: E402

TEXT = (
    "The café on the corner serves crème brûlée and naïve jalapeño piñatas. "
    "東京の天気は晴れです。我们今天去公园散步吧！ 한국어도 조금 섞어 봅니다. "
    "Emoji: 😀🚀🎉👍🏽 and math: ∑ x² ≤ ∞, ±3 °C, €12.50. "
    "Plain English text follows, the most common case for a model's output, with digits 12345 "
    "and punctuation; then code: def f(x): return x * 2  # double it\n"
)
PROMPT = "Write a short multilingual note:"


def time_per_token(tok: Any, ids: list[int], stream: bool, stop: list[str], expected: str) -> float:
    """Seconds per token for one pass over `ids` (checked against `expected`)."""
    prompt_ids = tok.encode(PROMPT)
    start = time.perf_counter()
    detok = IncrementalDetokenizer(tok, prompt_ids, stop, False, True, use_decode_stream=stream)
    chunks = []
    for token in ids:
        detok.add_token(token)
        chunks.append(detok.take_new_text(False))
    chunks.append(detok.take_new_text(True))
    elapsed = time.perf_counter() - start
    text = "".join(chunks)
    if text != expected:
        raise AssertionError(f"{'DecodeStream' if stream else 'window'} text differs from decode")
    return elapsed / len(ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=400, help="output tokens (default: 400)")
    parser.add_argument("--rounds", type=int, default=7, help="alternating rounds (default: 7)")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from tests.tiny_checkpoints import tiny_tokenizer
    from tokenwise.default_model import DEFAULT_MODEL_DIR

    tokenizers = {
        "default model (BPE 4096)": AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR),
        "tests' tiny BPE (300)": tiny_tokenizer(),
    }
    cases = {"no stop strings": [], "2 stop strings": ["\n\n", "###"]}
    print(
        f"{'tokenizer':<26} {'case':<16} {'tokens':>6} {'window us/tok':>14} "
        f"{'stream us/tok':>14} {'speed-up':>9}"
    )
    for name, tok in tokenizers.items():
        ids: list[int] = []
        while len(ids) < args.tokens:
            ids += tok.encode(TEXT, add_special_tokens=False)
        ids = ids[: args.tokens]
        multibyte = sum(1 for t in ids if "\ufffd" in tok.decode([t]))
        expected = tok.decode(ids, skip_special_tokens=True).rstrip("\ufffd")  # cut-off char
        for case, stop in cases.items():
            best = {False: float("inf"), True: float("inf")}
            for _ in range(args.rounds):
                for stream in (False, True):
                    best[stream] = min(
                        best[stream], time_per_token(tok, ids, stream, stop, expected)
                    )
            window_us, stream_us = best[False] * 1e6, best[True] * 1e6
            print(
                f"{name:<26} {case:<16} {len(ids):>6} {window_us:>14.2f} {stream_us:>14.2f} "
                f"{window_us / stream_us:>8.2f}x"
            )
        print(
            f"{'':<26} ({multibyte} of the {len(ids)} tokens decode to U+FFFD alone: part of a character)"
        )


if __name__ == "__main__":
    main()
