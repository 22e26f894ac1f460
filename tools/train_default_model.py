"""Train tokenwise's built-in default model: a tiny Llama trained on the Python standard library.

Why this exists: ``make run`` and the examples must produce recognisable output on a fresh
machine that cannot download anything. So tokenwise ships a small checkpoint of its own, in the
ordinary Hugging Face layout, which exercises the same code paths as a real Llama (RoPE, GQA,
RMSNorm, SwiGLU, tied embeddings) and whose greedy continuations visibly look like Python.

Everything here is built from data that is already on every machine with Python on it: the
``*.py`` files of the standard library. The script

1. collects and shuffles those files (seeded) and holds out a few percent for validation,
2. trains a byte-level BPE tokenizer on the training files,
3. trains a small ``LlamaForCausalLM`` for a fixed wall-clock budget (CPU is fine),
4. writes ``config.json``, ``model.safetensors``, tokenizer files, ``generation_config.json``
   and a model card ``README.md`` into ``--out``.

By default training runs for a wall-clock budget (``--minutes``): the cosine decay follows the
fraction of the budget spent, and the thread count follows the machine's current load, so the
run ends on time and fully decayed on a shared 2-core box. ``--steps N`` instead runs exactly N
steps with a fixed thread count, which is deterministic on a given machine.

Example::

    python tools/train_default_model.py --minutes 15
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

# Excluded because they are tests, big, repetitive, or not ordinary Python code.
EXCLUDED_DIRS = {
    "test",
    "tests",
    "idlelib",
    "lib2to3",
    "site-packages",
    "__pycache__",
    "encodings",  # ~120 generated charmap tables
    "pydoc_data",  # one 750 kB file of English help text
}
EOS_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|begin_of_text|>"
SAMPLE_PROMPTS = ("def fibonacci(n):", "import os")


def log(msg: str) -> None:
    """Print with a timestamp and flush, because the script normally runs under nohup."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------


def collect_stdlib_files(root: Path) -> list[Path]:
    """All stdlib ``*.py`` files outside the excluded dirs, sorted so the seed fully decides
    the later shuffle regardless of filesystem ordering."""
    files = []
    for path in root.rglob("*.py"):
        rel_parts = path.relative_to(root).parts
        if any(part in EXCLUDED_DIRS for part in rel_parts[:-1]):
            continue
        if path.is_file():
            files.append(path)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def read_documents(files: list[Path]) -> list[str]:
    """Read files as UTF-8; files that are not valid UTF-8 (a handful of encoding test
    fixtures) are skipped rather than decoded lossily, so the model never sees mojibake."""
    docs = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            docs.append(text)
    return docs


def train_tokenizer(docs: list[str], vocab_size: int):
    """Byte-level BPE, like GPT-2/Llama 3: every byte is representable, so no <unk> exists.

    No post-processor is attached, so encoding never adds BOS behind the caller's back; the
    training stream adds BOS/EOS explicitly instead.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN, BOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    return tok


def encode_stream(tok, docs: list[str], bos_id: int, eos_id: int) -> np.ndarray:
    """Concatenate documents as ``BOS doc EOS BOS doc EOS ...`` into one token array.

    EOS separates documents (and is what generation stops on); BOS marks where a file starts,
    which also gives the BOS embedding some training in case a caller prepends it.
    """
    encodings = tok.encode_batch(docs)
    parts = [np.array([bos_id] + enc.ids + [eos_id], dtype=np.int64) for enc in encodings]
    return np.concatenate(parts)


def line_start_positions(tok, stream: np.ndarray) -> np.ndarray:
    """Stream positions whose token begins a top-level (column-0) line.

    Those are tokens that follow a token ending in a newline and do not themselves start with
    whitespace (the byte-level pre-tokenizer keeps indentation with the newline run).
    """
    vocab_size = tok.get_vocab_size()
    pieces = [tok.decode([i]) for i in range(vocab_size)]
    ends_line = np.array([p.endswith("\n") for p in pieces])
    starts_flush = np.array([bool(p) and not p[0].isspace() for p in pieces])
    prev_ok = ends_line[stream[:-1]]
    this_ok = starts_flush[stream[1:]]
    return np.nonzero(prev_ok & this_ok)[0] + 1


class RandomWindows:
    """Samples contiguous training windows from the token stream, seeded for reproducibility.

    A fraction of windows starts at a random offset, so the model copes with prompts that begin
    mid-code at any indentation. The rest start exactly at a top-level line, because that is
    what a typed prompt such as ``def fibonacci(n):`` looks like: without such windows the
    model never sees a context that starts at column 0 and, e.g., indents a top-level ``def``
    body as if it were a method.
    """

    def __init__(
        self,
        stream: np.ndarray,
        seq_len: int,
        seed: int,
        line_starts: np.ndarray | None = None,
        line_start_fraction: float = 0.0,
    ):
        self.stream = torch.from_numpy(stream)
        self.seq_len = seq_len
        self.gen = torch.Generator().manual_seed(seed)
        hi = len(stream) - seq_len - 1
        ls = np.empty(0, dtype=np.int64) if line_starts is None else line_starts
        self.line_starts = torch.from_numpy(ls[ls < hi].astype(np.int64))
        self.fraction = line_start_fraction if len(self.line_starts) else 0.0

    def batch(self, batch_size: int) -> torch.Tensor:
        hi = len(self.stream) - self.seq_len - 1
        starts = torch.randint(0, hi, (batch_size,), generator=self.gen)
        if self.fraction > 0:
            use_line = torch.rand(batch_size, generator=self.gen) < self.fraction
            picks = torch.randint(0, len(self.line_starts), (batch_size,), generator=self.gen)
            starts = torch.where(use_line, self.line_starts[picks], starts)
        idx = starts[:, None] + torch.arange(self.seq_len + 1)[None, :]
        return self.stream[idx]


# --------------------------------------------------------------------------------------------
# Model and training
# --------------------------------------------------------------------------------------------


@dataclass
class Schedule:
    """Linear warmup over ``warmup`` steps, then cosine decay to ``min_ratio * peak``.

    The decay is driven by a progress fraction rather than a step number, so the same schedule
    serves both modes: with ``--steps`` progress is the step fraction (deterministic), with a
    time budget it is the fraction of the post-warmup time spent, so the run ends on time and
    fully decayed however fast the (shared) machine happens to be.
    """

    peak_lr: float
    warmup: int
    min_ratio: float = 0.1

    def lr(self, step: int, progress: float) -> float:
        if step < self.warmup:
            return self.peak_lr * (step + 1) / self.warmup
        cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, max(0.0, progress))))
        return self.peak_lr * (self.min_ratio + (1.0 - self.min_ratio) * cosine)


class ThreadTuner:
    """Keeps switching to whichever of 1 and ``max_threads`` intra-op threads is faster now.

    Why: on a 2-core machine shared with other jobs, two OpenMP threads spin-wait on each
    other whenever a core is taken, and a step measured ~4x slower than with one thread; on an
    idle machine two threads are ~2x faster. Load changes within minutes, so every ``period``
    steps each option is timed for ``probe`` steps (the first of each discarded as warm-up) and
    the faster one is kept for the rest of the period.
    """

    def __init__(self, max_threads: int, period: int = 100, probe: int = 4):
        self.options = sorted({1, max_threads})
        self.period, self.probe = period, probe
        self.current = max_threads
        self.timings: dict[int, list[float]] = {}
        self.steps_at: dict[int, int] = dict.fromkeys(self.options, 0)

    def _probing(self, step: int) -> int | None:
        """The option being probed at this step, or None outside the probe window."""
        offset = step % self.period
        if len(self.options) == 1 or offset >= self.probe * len(self.options):
            return None
        return self.options[offset // self.probe]

    def before_step(self, step: int) -> None:
        threads = self._probing(step)
        threads = self.current if threads is None else threads
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        self.steps_at[threads] += 1

    def after_step(self, step: int, seconds: float) -> None:
        threads = self._probing(step)
        if threads is None:
            return
        if step % self.probe:  # skip the first step of each probe (thread-pool warm-up)
            self.timings.setdefault(threads, []).append(seconds)
        if step % self.period == self.probe * len(self.options) - 1:
            means = {t: sum(v) / len(v) for t, v in self.timings.items() if v}
            best = min(means, key=means.get)
            if best != self.current:
                log(
                    f"switching to {best} thread(s): "
                    + ", ".join(f"{t}: {m:.2f}s/step" for t, m in sorted(means.items()))
                )
            self.current, self.timings = best, {}


def build_model(args: argparse.Namespace, vocab_size: int, bos_id: int, eos_id: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    head_dim = args.hidden_size // args.num_heads
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads,
        head_dim=head_dim,
        hidden_act="silu",
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        initializer_range=0.02,
    )
    model = LlamaForCausalLM(config)
    return model


def loss_on(model, batch: torch.Tensor, use_bf16: bool) -> torch.Tensor:
    """Next-token cross-entropy; computed explicitly so the shift is visible and in fp32."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16):
        logits = model(input_ids=inputs).logits
    return torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1)
    )


@torch.no_grad()
def evaluate(model, stream: np.ndarray, seq_len: int, max_tokens: int, use_bf16: bool) -> float:
    """Mean loss over fixed, non-overlapping windows of held-out files (deterministic)."""
    model.eval()
    data = torch.from_numpy(stream)
    n_windows = max(1, min(max_tokens, len(data) - 1) // seq_len)
    starts = list(range(0, n_windows * seq_len, seq_len))
    total = 0.0
    for i in range(0, len(starts), 8):
        rows = torch.stack([data[s : s + seq_len + 1] for s in starts[i : i + 8]])
        total += loss_on(model, rows, use_bf16).item() * len(rows)
    model.train()
    return total / len(starts)


@torch.no_grad()
def greedy_samples(model, tokenizer, max_new_tokens: int = 40) -> dict[str, str]:
    """Greedy continuations of the sample prompts via transformers' own ``generate``."""
    model.eval()
    out = {}
    for prompt in SAMPLE_PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        gen = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.eos_token_id,
        )
        out[prompt] = tokenizer.decode(gen[0], skip_special_tokens=False)
    model.train()
    return out


def benchmark_bf16(model, windows: RandomWindows, batch_size: int, steps: int = 3) -> bool:
    """Time a few forward+backward passes in fp32 and under bf16 autocast; pick the faster.

    On CPUs without native bf16 (no AVX512-BF16/AMX) autocast is usually slower, so this is
    measured rather than assumed. Gradients are discarded and the RNG state restored so the
    measurement does not change the training run.
    """
    rng_state = windows.gen.get_state()
    batch = windows.batch(batch_size)
    windows.gen.set_state(rng_state)
    timings = {}
    for use_bf16 in (False, True):
        loss_on(model, batch, use_bf16).backward()  # warm-up pass
        t0 = time.perf_counter()
        for _ in range(steps):
            loss_on(model, batch, use_bf16).backward()
        timings[use_bf16] = (time.perf_counter() - t0) / steps
        model.zero_grad(set_to_none=True)
    log(f"step time fp32={timings[False]:.2f}s bf16-autocast={timings[True]:.2f}s")
    return timings[True] < 0.9 * timings[False]


def describe_cpu() -> str:
    """CPU model and core count for the card: training speed depends on it entirely."""
    name = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name} ({os.cpu_count()} cores)"


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------


def write_model_card(out: Path, info: dict) -> None:
    """A short model card so that the committed checkpoint explains itself."""
    samples = "\n\n".join(
        f"Prompt `{p!r}`:\n\n```python\n{text}\n```" for p, text in info["samples"].items()
    )
    card = f"""# tokenwise default model

A tiny Llama-architecture causal LM that ships with tokenwise so that `make run` and the examples
produce recognisable output offline. It writes Python-looking code and nothing else; it is a test
and demo fixture, not a useful assistant.

## Architecture

`LlamaForCausalLM` (transformers), {info["params"]:,} parameters, weights stored in {info["dtype"]}.

| setting | value |
|---|---|
| hidden size | {info["hidden_size"]} |
| intermediate size (SwiGLU) | {info["intermediate_size"]} |
| layers | {info["num_layers"]} |
| attention heads / KV heads (GQA) | {info["num_heads"]} / {info["num_kv_heads"]} |
| head dim | {info["head_dim"]} |
| vocab | {info["vocab_size"]} (byte-level BPE) |
| max position embeddings | 1024 (trained on {info["seq_len"]}-token windows) |
| RoPE theta | 10000 |
| tied embeddings | yes |
| BOS / EOS | `{BOS_TOKEN}` ({info["bos_id"]}) / `{EOS_TOKEN}` ({info["eos_id"]}) |

The tokenizer does not add BOS automatically. Training documents were laid out as
`BOS file EOS BOS file EOS ...`, so prompts work with or without a leading BOS, and the model
emits EOS when it thinks a file has ended.

## Data

The `*.py` files of the Python {info["python_version"]} standard library
(`sysconfig.get_paths()["stdlib"]`), excluding the directories {info["excluded"]}
(tests, plus data tables and prose rather than code).
{info["n_train_files"]} training files ({info["train_tokens"]:,} tokens) and {info["n_val_files"]}
held-out validation files ({info["val_tokens"]:,} tokens), split by a seeded shuffle of the
sorted file list.

## Training

- seed {info["seed"]}; {info["precision"]}; {info["machine"]}
- AdamW (betas 0.9/0.95, weight decay {info["weight_decay"]}), peak LR {info["lr"]},
  {info["warmup"]} warmup steps then cosine decay to 10% {info["decay_over"]},
  gradient clipping 1.0
- {info["steps"]} steps of {info["batch_size"]} x {info["seq_len"]} tokens
  ({info["tokens_seen"]:,} tokens, {info["epochs"]:.2f} epochs); {info["line_start_pct"]:.0%} of
  windows start at a top-level line (as typed prompts do), the rest at random offsets
- time: training loop {info["train_minutes"]:.1f} min, whole script
  {info["total_minutes"]:.1f} min. {info["threads_note"]}
- final train loss (mean of the last 20 steps): {info["train_loss"]:.3f}
- validation loss (held-out files): {info["val_loss"]:.3f}

## Greedy samples

`generate(..., do_sample=False, max_new_tokens=40)`:

{samples}

## Reproduce

```
{info["command"]}
```

{info["reproduce_note"]}
"""
    (out / "README.md").write_text(card, encoding="utf-8")


def save_checkpoint(model, tokenizer, out: Path, bos_id: int, eos_id: int) -> None:
    """Write an ordinary HF checkpoint directory (fp32 safetensors, tokenizer, gen config)."""
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    model.config.architectures = ["LlamaForCausalLM"]
    # Only the stopping token; sampling settings are left to the caller.
    model.generation_config = GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_id)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    # transformers 5 records its new "TokenizersBackend" class, which 4.x cannot import; the
    # older name loads the same tokenizer.json in both, and the project supports both.
    config_path = out / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text(encoding="utf-8"))
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tok_config, indent=2) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="tokenwise/models_data/default", help="output directory")
    p.add_argument("--minutes", type=float, default=15.0, help="training-loop time budget")
    p.add_argument(
        "--steps", type=int, default=None, help="fixed step count instead of a time budget"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument(
        "--tokenizer",
        default=None,
        help="reuse this checkpoint directory's tokenizer.json instead of training one (a "
        "draft model for speculative decoding: e.g. tokenwise/models_data/default)",
    )
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--intermediate-size", type=int, default=688)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument(
        "--line-start-fraction",
        type=float,
        default=0.5,
        help="share of training windows that start at a top-level line (rest: random offsets)",
    )
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--val-fraction", type=float, default=0.02)
    p.add_argument("--val-tokens", type=int, default=65536, help="max held-out tokens scored")
    p.add_argument(
        "--threads",
        type=int,
        default=2,
        help="torch intra-op threads; with a time budget 1 thread is also tried periodically "
        "and the faster kept (on a busy machine 1 is often much faster)",
    )
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument(
        "--precision",
        choices=["auto", "fp32", "bf16-autocast"],
        default="fp32",
        help="auto times both and keeps the faster (bf16 autocast only pays off on CPUs with "
        "native bf16); weights are always saved in fp32",
    )
    args = p.parse_args(argv)
    if args.tokenizer is not None and Path(args.tokenizer).resolve() == Path(args.out).resolve():
        p.error("--out would overwrite the checkpoint whose tokenizer is reused: give --out")
    if args.num_heads % args.num_kv_heads or args.hidden_size % args.num_heads:
        p.error("hidden size must divide into heads, and heads into KV heads")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    t_script = time.perf_counter()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    from transformers import PreTrainedTokenizerFast

    # 1. Data split.
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = collect_stdlib_files(stdlib)
    random.Random(args.seed).shuffle(files)
    n_val = max(1, round(len(files) * args.val_fraction))
    val_files, train_files = files[:n_val], files[n_val:]
    train_docs, val_docs = read_documents(train_files), read_documents(val_files)
    log(f"{stdlib}: {len(train_docs)} train / {len(val_docs)} val files")

    # 2. Tokenizer (trained on training files only, so validation is honest), or an existing
    # model's: a draft model for speculative decoding must share its target's vocabulary.
    if args.tokenizer is not None:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(Path(args.tokenizer) / "tokenizer.json"))
    else:
        tok = train_tokenizer(train_docs, args.vocab_size)
    eos_id, bos_id = tok.token_to_id(EOS_TOKEN), tok.token_to_id(BOS_TOKEN)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN, model_max_length=1024
    )
    train_stream = encode_stream(tok, train_docs, bos_id, eos_id)
    val_stream = encode_stream(tok, val_docs, bos_id, eos_id)
    log(
        f"tokenizer: vocab {tok.get_vocab_size()}, train {len(train_stream):,} tokens, "
        f"val {len(val_stream):,} tokens ({sum(map(len, train_docs)) / len(train_stream):.2f} "
        "chars/token)"
    )

    # 3. Model.
    model = build_model(args, tok.get_vocab_size(), bos_id, eos_id)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params:,} parameters")
    model.train()
    line_starts = line_start_positions(tok, train_stream)
    windows = RandomWindows(
        train_stream, args.seq_len, args.seed, line_starts, args.line_start_fraction
    )
    log(f"{len(line_starts):,} top-level line starts; {args.line_start_fraction:.0%} of windows")

    if args.precision == "auto":
        use_bf16 = benchmark_bf16(model, windows, args.batch_size)
    else:
        use_bf16 = args.precision == "bf16-autocast"
    precision = "bf16 autocast (fp32 master weights)" if use_bf16 else "fp32"
    log(f"precision: {precision}")

    # Weight decay only on matrices; norms (1-D) are left alone, as is usual.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )

    # 4. Train, for --steps steps (fixed threads: deterministic) or until the time budget is
    # spent (threads tuned to the machine's current load; the step count follows from speed).
    budget_s = args.minutes * 60.0
    schedule = Schedule(args.lr, args.warmup)
    tuner = ThreadTuner(args.threads) if args.steps is None else None
    t_train = time.perf_counter()
    t_decay = t_train  # when warmup ended; time-budget progress is measured from here
    recent: list[float] = []
    step = 0
    while True:
        now = time.perf_counter()
        if args.steps is not None:
            if step >= args.steps:
                break
            progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        else:
            if now - t_train >= budget_s:
                break
            if step == args.warmup:
                t_decay = now
            progress = (now - t_decay) / max(1.0, budget_s - (t_decay - t_train))
        if tuner is not None:
            tuner.before_step(step)
        lr = schedule.lr(step, progress)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss = loss_on(model, windows.batch(args.batch_size), use_bf16)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        recent = (recent + [loss.item()])[-20:]
        if tuner is not None:
            tuner.after_step(step, time.perf_counter() - now)
        step += 1
        if step % args.log_every == 0:
            elapsed = time.perf_counter() - t_train
            log(
                f"step {step} loss {sum(recent) / len(recent):.3f} lr {lr:.2e} "
                f"threads {torch.get_num_threads()} {elapsed / 60:.1f} min"
            )
    train_s = time.perf_counter() - t_train
    train_loss = sum(recent) / len(recent)

    val_loss = evaluate(model, val_stream, args.seq_len, args.val_tokens, use_bf16)
    log(f"final train loss {train_loss:.3f}, validation loss {val_loss:.3f}")

    # 5. Save and describe. Samples come from the reloaded checkpoint, so they show what users get.
    out = Path(args.out)
    save_checkpoint(model, tokenizer, out, bos_id, eos_id)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    samples = greedy_samples(reloaded, AutoTokenizer.from_pretrained(out))
    for prompt, text in samples.items():
        log(f"sample for {prompt!r}:\n{text}\n" + "-" * 60)

    command = f"python tools/train_default_model.py --out {args.out} --seed {args.seed}"
    command += (
        f" --steps {args.steps}" if args.steps is not None else f" --minutes {args.minutes:g}"
    )
    defaults = vars(parse_args([]))
    for key, value in vars(args).items():
        skip = ("out", "minutes", "steps", "seed", "log_every")
        if key not in skip and value != defaults[key]:
            command += f" --{key.replace('_', '-')} {value}"
    if tuner is None:
        threads_note = f"{args.threads} torch thread(s) throughout."
        decay_over = "over the steps"
        reproduce_note = (
            "A fixed step count and thread count make the run deterministic on a given machine "
            "(same Python standard library, library versions and CPU kernels)."
        )
    else:
        counts = [f"{n} steps on {t} thread(s)" for t, n in sorted(tuner.steps_at.items()) if n]
        threads_note = (
            " and ".join(counts) + " (whichever was faster, re-measured every 100 steps)."
        )
        decay_over = "over the remaining time budget"
        reproduce_note = (
            "The budget is wall-clock time, so the step count, and with it the exact losses, "
            f"depend on the machine's speed and load. For a deterministic run of the same length "
            f"use `--steps {step}` instead of `--minutes` (step-driven decay, fixed threads)."
        )
    info = {
        "params": n_params,
        "dtype": "float32",
        "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size,
        "num_layers": args.num_layers,
        "num_heads": args.num_heads,
        "num_kv_heads": args.num_kv_heads,
        "head_dim": args.hidden_size // args.num_heads,
        "vocab_size": tok.get_vocab_size(),
        "seq_len": args.seq_len,
        "bos_id": bos_id,
        "eos_id": eos_id,
        "python_version": sysconfig.get_python_version(),
        "n_train_files": len(train_docs),
        "n_val_files": len(val_docs),
        "train_tokens": len(train_stream),
        "val_tokens": len(val_stream),
        "seed": args.seed,
        "weight_decay": args.weight_decay,
        "lr": args.lr,
        "warmup": args.warmup,
        "steps": step,
        "threads_note": threads_note,
        "line_start_pct": args.line_start_fraction,
        "decay_over": decay_over,
        "reproduce_note": reproduce_note,
        "excluded": ", ".join(f"`{d}`" for d in sorted(EXCLUDED_DIRS - {"__pycache__"})),
        "batch_size": args.batch_size,
        "tokens_seen": step * args.batch_size * args.seq_len,
        "epochs": step * args.batch_size * args.seq_len / len(train_stream),
        "precision": precision,
        "machine": f"{describe_cpu()}, torch {torch.__version__}",
        "train_minutes": train_s / 60,
        "total_minutes": (time.perf_counter() - t_script) / 60,
        "train_loss": train_loss,
        "val_loss": val_loss,
        "samples": samples,
        "command": command,
    }
    write_model_card(out, info)
    log(f"wrote {out} ({sum(f.stat().st_size for f in out.iterdir()) / 1e6:.1f} MB)")


if __name__ == "__main__":
    sys.exit(main())
