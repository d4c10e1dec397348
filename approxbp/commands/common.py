"""What the subcommands share: argument helpers, the progress switch, the figures folder, a table's summary."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["add_common", "no_progress", "out_arg", "progress_on", "table_paths_arg"]


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=0, help="root seed; restarts use independent child seeds")
    p.add_argument("--restarts", type=int, default=4, help="seeded restarts of the method (structured starts and "
                   "a knot-relocation pass come on top)")
    p.add_argument("--workers", type=int, default=None, help="processes for restarts (None: all cores)")
    no_progress(p)


def table_paths_arg(p: argparse.ArgumentParser, none: str, name: str = "tables") -> None:
    """The positional table paths of a subcommand; ``none`` says what it takes when none is given."""
    p.add_argument(name, nargs="*", type=Path, help=f"table paths (none: {none})")


def no_progress(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-progress", action="store_true", help="hide progress (bars on a terminal, lines in a log)")


def out_arg(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--out", type=Path, default=None,
                   help=f"folder for {what} (None: docs/figures of the source checkout; elsewhere required)")


def progress_on(args) -> bool:
    return not getattr(args, "no_progress", False)
