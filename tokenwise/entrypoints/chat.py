"""`tokenwise chat`: an interactive loop over the engine.

With a chat template in the tokenizer, the conversation so far is rendered with it each turn;
without one (the built-in model is a code model), each line is simply continued.
"""

from __future__ import annotations

import argparse
import sys

from tokenwise.entrypoints.engine_args import engine_kwargs
from tokenwise.sampling.params import SamplingParams


def run_chat(args: argparse.Namespace, params: SamplingParams) -> int:
    from tokenwise.entrypoints.llm import LLM

    llm = LLM(args.model, **engine_kwargs(args))
    tokenizer = llm.get_tokenizer()
    templated = getattr(tokenizer, "chat_template", None) is not None
    messages: list[dict[str, str]] = []
    interactive = sys.stdin.isatty()
    mode = "chat template" if templated else "plain continuation (the model has no chat template)"
    print(f"tokenwise chat: {mode}. /exit or Ctrl-D quits.", file=sys.stderr)
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() == "/exit":
            return 0
        user = line.rstrip("\n")
        if not user.strip():
            continue
        if templated:
            messages.append({"role": "user", "content": user})
            prompt = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        else:
            prompt = user
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        reply = out.outputs[0].text
        print(reply if templated else f"{user}{reply}", flush=True)
        if templated:
            messages.append({"role": "assistant", "content": reply})
