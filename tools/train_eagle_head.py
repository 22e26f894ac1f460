"""Train a small EAGLE-1 head for a Llama checkpoint (the built-in model by default).

    python tools/train_eagle_head.py --out DIR [--target DIR] [--steps 300] [--skip 64]

A benchmark of EAGLE with a random head measures only its cost (nothing is accepted); this
gives a head that has learnt something, to put figures beside it. The head is the published
EAGLE-1 layout (what `tokenwise` loads with `{"method": "eagle", "model": DIR}`): `fc`
(`[h, 2h]`, with bias) over (embedding of the token at p + 1, the target's last hidden state
at p), one Llama decoder layer without input norm, the target's embedding and LM head. It is
built from transformers' Llama modules and trained on the target's own features, as EAGLE is:
a smooth-L1 regression onto the target's hidden state at p + 1 plus 0.1 x the cross-entropy of
the target's LM head over the head's output against the target's greedy token after p + 1 (the
token greedy verification accepts). Teacher-forced: each position reads the target's features.

Data: Python standard library source (what the built-in model was trained on), one file after
another, leaving out the `--skip` files whose functions `benchmarks/spec_decode.py` prompts with.
"""

from __future__ import annotations

import argparse
import os
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

DEFAULT_TARGET = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    "tokenwise",
    "models_data",
    "default",
)


class EagleHead(nn.Module):
    """EAGLE-1 with the published parameter names (`fc.*`, `layers.0.*`)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=True)
        layer = LlamaDecoderLayer(config, 0)
        layer.input_layernorm = nn.Identity()  # EAGLE's layer 0 has none
        self.layers = nn.ModuleList([layer])
        self.rotary = LlamaRotaryEmbedding(config)

    def forward(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """`[B, T, h]` inputs at positions 0..T-1; the head's outputs."""
        x = self.fc(torch.cat([embeds, features], dim=-1))
        positions = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
        out = self.layers[0](
            x, position_ids=positions, position_embeddings=self.rotary(x, positions)
        )
        return out[0] if isinstance(out, tuple) else out


def corpus(tokenizer: object, skip: int, max_tokens: int) -> torch.Tensor:
    """Standard library files' tokens, one after another, after the first `skip` files."""
    ids: list[int] = []
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[skip:]
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        ids += tokenizer(text)["input_ids"]  # type: ignore[operator]
        if len(ids) >= max_tokens:
            break
    return torch.tensor(ids[:max_tokens])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--tokens", type=int, default=200_000, help="corpus size")
    p.add_argument("--skip", type=int, default=64, help="stdlib files left out (benchmark's)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    tc = target.config
    config = LlamaConfig(
        hidden_size=tc.hidden_size,
        intermediate_size=tc.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads,
        head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads,
        vocab_size=tc.vocab_size,
        max_position_embeddings=tc.max_position_embeddings,
        rms_norm_eps=tc.rms_norm_eps,
        bos_token_id=tc.bos_token_id,
        eos_token_id=tc.eos_token_id,
        architectures=["LlamaForCausalLM"],
    )
    config._attn_implementation = "sdpa"
    head = EagleHead(config)
    ids = corpus(tokenizer, args.skip, args.tokens)
    windows = ids[: len(ids) // args.window * args.window].view(-1, args.window)
    print(f"{len(ids)} tokens, {len(windows)} windows of {args.window}", flush=True)
    with torch.no_grad():  # the target's features and greedy tokens, once
        feats, greedy = [], []
        for chunk in windows.split(32):
            hidden = target.model(chunk).last_hidden_state
            feats.append(hidden)
            greedy.append(target.lm_head(hidden).argmax(-1))
        features, labels = torch.cat(feats), torch.cat(greedy)
    embed, lm_head = target.model.embed_tokens, target.lm_head
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr)
    start = time.time()
    for step in range(args.steps):
        rows = torch.randint(0, len(windows), (args.batch,))
        tok, feat, lab = windows[rows], features[rows], labels[rows]
        with torch.no_grad():
            embeds = embed(tok[:, 1:-1])  # the token at p + 1, for p = 0..T-3
        out = head(embeds, feat[:, :-2])
        regression = F.smooth_l1_loss(out, feat[:, 1:-1])
        logits = lm_head(out)
        ce = F.cross_entropy(logits.flatten(0, 1), lab[:, 1:-1].flatten())
        loss = regression + 0.1 * ce
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == args.steps - 1:
            acc = (logits.argmax(-1) == lab[:, 1:-1]).float().mean().item()
            print(
                f"step {step}: loss {loss.item():.3f} (ce {ce.item():.3f}), greedy agreement "
                f"{acc:.1%}, {time.time() - start:.0f} s",
                flush=True,
            )
    os.makedirs(args.out, exist_ok=True)
    config.save_pretrained(args.out)
    state = {k: v.detach().contiguous() for k, v in head.state_dict().items() if "rotary" not in k}
    save_file(state, os.path.join(args.out, "model.safetensors"), metadata={"format": "pt"})
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
