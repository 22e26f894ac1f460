"""Settings declared as dataclass fields -> argparse flags and back.

`setting(...)` is a dataclass field whose metadata says how the setting is spelled on a
command line; `add_flags` adds one flag per field to a parser and `flag_values` reads the
parsed values back as keyword arguments. `EngineArgs` (`engine_args.py`) is built from it, so
a setting is declared in one place and the CLI cannot drift from `LLM(...)`.
Standard library only: building a parser stays instant.
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, Field, field, fields
from typing import Any

ALL_COMMANDS = "all"  # where a flag is offered: every engine command...
SERVE_ONLY = "serve"  # ...or `serve` alone


def setting(
    default: Any,
    help: str,
    *,
    flags: tuple[str, ...] = (),
    type: Any = None,
    choices: Any = None,
    metavar: str | None = None,
    const: Any = MISSING,
    group: str = "engine",
    commands: str = ALL_COMMANDS,
    extra_flags: tuple[tuple[tuple[str, ...], dict[str, Any]], ...] = (),
    alias_of: str | None = None,
    cli_default: Any = MISSING,
) -> Any:
    """One setting: a dataclass field whose metadata generates its command-line flag.

    `flags`: the option strings (default: `--` + the name with dashes, vLLM's spelling);
    `const`: the flag takes no value and stores this (a tri-state such as enforce_eager);
    `extra_flags`: more options writing the same field (`--compile` sets enforce_eager=False);
    `alias_of`: the field is another name for that one (vLLM's `enable_dbo`), whose flags then
    carry this one's spelling; `cli_default`: where the command's default differs on purpose
    (the server logs requests, the offline API does not). A bool field is a switch: `--x`
    when off by default, vLLM's `--x` / `--no-x` pair when on.
    """
    meta = {
        "help": help,
        "flags": flags,
        "type": type,
        "choices": choices,
        "metavar": metavar,
        "const": const,
        "group": group,
        "commands": commands,
        "extra_flags": extra_flags,
        "alias_of": alias_of,
        "cli_default": cli_default,
    }
    return field(default=default, metadata=meta)


def option_strings(f: Field) -> tuple[str, ...]:
    """The command-line spelling of a setting: its own flags, or `--` + its dashed name."""
    return f.metadata["flags"] or ("--" + f.name.replace("_", "-"),)


def cli_default(f: Field) -> Any:
    """The default a command line gives the setting (its field default unless declared)."""
    return f.default if f.metadata["cli_default"] is MISSING else f.metadata["cli_default"]


def _argparse_kwargs(f: Field) -> dict[str, Any]:
    meta = f.metadata
    default = cli_default(f)
    kwargs: dict[str, Any] = {"dest": f.name, "default": default, "help": meta["help"]}
    if meta["const"] is not MISSING:
        kwargs.update(action="store_const", const=meta["const"])
    elif isinstance(f.default, bool):
        kwargs["action"] = argparse.BooleanOptionalAction if default else "store_true"
    else:
        for key in ("type", "choices", "metavar"):
            if meta[key] is not None:
                kwargs[key] = meta[key]
    return kwargs


def declared_fields(settings: type) -> list[Field]:
    """The fields of `settings` with the class's own first, then those it inherits (a base
    such as `ParallelArgs` holds a group declared apart): the order of the flags and docs."""
    own = vars(settings).get("__annotations__", {})
    return sorted(fields(settings), key=lambda f: f.name not in own)


def add_flags(parser: argparse.ArgumentParser, settings: type, commands: str) -> None:
    """One flag per field of the `settings` dataclass offered to `commands`, grouped as
    declared; alias fields add no flag of their own (their spelling is on the target's)."""
    groups: dict[str, Any] = {}
    for f in declared_fields(settings):
        meta = f.metadata
        if "commands" not in meta or meta["commands"] != commands or meta["alias_of"]:
            continue
        if meta["group"] not in groups:
            groups[meta["group"]] = parser.add_argument_group(meta["group"])
        group = groups[meta["group"]]
        group.add_argument(*option_strings(f), **_argparse_kwargs(f))
        for extra, extra_kwargs in meta["extra_flags"]:
            group.add_argument(*extra, dest=f.name, **extra_kwargs)


def flag_values(
    args: argparse.Namespace, settings: type, skip: tuple[str, ...] = ()
) -> dict[str, Any]:
    """The fields of `settings` as keyword arguments from parsed flags; a flag the command
    does not offer keeps the field's default. Alias fields and `skip` are left out."""
    return {
        f.name: getattr(args, f.name, f.default)
        for f in fields(settings)
        if f.name not in skip and not f.metadata.get("alias_of")
    }
