"""Subcommands beyond generate/chat (serve, bench) register here as they are added."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the optional subcommands; each imports its heavy dependencies lazily."""
