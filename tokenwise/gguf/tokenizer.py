"""The tokenizer directory a GGUF model runs with, with the file's chat template.

The engine loads its tokenizer from a directory (`AutoTokenizer.from_pretrained(path)`, in
every process that needs one). A GGUF model gets one of three:

- `tokenizer=<HF dir>` and a file without `tokenizer.chat_template`: that directory, as is;
- `tokenizer=<HF dir>` and a file with a chat template: a copy of that tokenizer carrying the
  file's template, since the file is the model being served and llama.cpp users expect its
  template (`tokenwise serve model.gguf` as llama-server does);
- no directory: transformers' conversion of the tokenizer in the GGUF metadata
  (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`, which carries the chat template too).
  Where transformers cannot convert it, the error asks for `tokenizer=` / `--tokenizer`.

Derived tokenizers are written once under `~/.cache/tokenwise/gguf-tokenizers` (or
`$TOKENWISE_GGUF_CACHE`), keyed by the file's path, size and modification time and the source
directory, so every engine process reads the same files and a second start converts nothing.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile

from tokenwise import envs
from tokenwise.gguf.reader import read_metadata

logger = logging.getLogger(__name__)


def cache_root() -> str:
    root = envs.get("TOKENWISE_GGUF_CACHE")
    if root:
        return root
    base = envs.external("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tokenwise", "gguf-tokenizers")


def _cache_key(path: str, tokenizer_dir: str | None) -> str:
    stat = os.stat(path)
    parts = [os.path.abspath(path), str(stat.st_size), str(stat.st_mtime_ns)]
    if tokenizer_dir is not None:
        parts += [os.path.abspath(tokenizer_dir), str(os.stat(tokenizer_dir).st_mtime_ns)]
    return hashlib.sha1("\0".join(parts).encode()).hexdigest()[:16]


# Architectures whose tokenizer transformers' GGUF reader does not build from the file itself,
# and the architecture named in a copy holding only the tokenizer's keys, which it does build:
# gpt-oss (transformers 5.x reads its `rope.scaling.*` values from the wrong part of the field)
# and Qwen3-Next (no GGUF support in transformers; its tokenizer is Qwen3's byte-level BPE).
TOKENIZER_ONLY = {"gpt-oss": "gpt-oss", "qwen3next": "qwen3"}


def _tokenizer_only_copy(path: str, arch: str, directory: str) -> str:
    """A GGUF file in `directory` with `path`'s tokenizer keys under architecture `arch`."""
    import gguf

    from tokenwise.gguf.reader import open_gguf

    reader = open_gguf(path)
    out = os.path.join(directory, "tokenizer.gguf")
    writer = gguf.GGUFWriter(out, arch)
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            sub_type = field.types[1] if len(field.types) > 1 else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _build(path: str, tokenizer_dir: str | None, chat_template: str | None) -> object:
    from transformers import AutoTokenizer

    if tokenizer_dir is not None:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    else:
        metadata, _ = read_metadata(path)
        with tempfile.TemporaryDirectory() as scratch:
            source = path
            arch = metadata.get("general.architecture")
            if arch in TOKENIZER_ONLY:
                source = _tokenizer_only_copy(path, TOKENIZER_ONLY[arch], scratch)
            directory, name = os.path.split(os.path.abspath(source))
            try:
                tokenizer = AutoTokenizer.from_pretrained(
                    directory, gguf_file=name, local_files_only=True
                )
            except Exception as exc:  # transformers raises many kinds here; all mean "cannot"
                raise ValueError(
                    f"transformers cannot build a tokenizer from the metadata of GGUF file "
                    f"{path!r} ({type(exc).__name__}: {exc}); pass the original model's "
                    "tokenizer directory with tokenizer=<dir> (--tokenizer <dir>)"
                ) from exc
    if chat_template:
        tokenizer.chat_template = chat_template
    return tokenizer


def prepare_tokenizer(path: str, tokenizer_dir: str | None) -> str:
    """The tokenizer directory for the GGUF model at `path` (see the module docstring)."""
    if tokenizer_dir is not None and not os.path.isdir(tokenizer_dir):
        raise FileNotFoundError(f"tokenizer directory {tokenizer_dir!r} does not exist")
    metadata, _ = read_metadata(path)
    chat_template = metadata.get("tokenizer.chat_template")
    if tokenizer_dir is not None and not chat_template:
        return tokenizer_dir
    target = os.path.join(cache_root(), _cache_key(path, tokenizer_dir))
    if os.path.isdir(target):
        return target
    tokenizer = _build(path, tokenizer_dir, chat_template)
    os.makedirs(cache_root(), exist_ok=True)
    staging = tempfile.mkdtemp(dir=cache_root())
    try:
        tokenizer.save_pretrained(staging)
        os.replace(staging, target)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not os.path.isdir(target):  # another process won the race: theirs is the same
            raise
    source = tokenizer_dir or "the GGUF metadata"
    logger.info("GGUF %s: tokenizer from %s, written to %s", path, source, target)
    return target
