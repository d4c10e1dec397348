"""``approxbp``: one entry point, a thin subcommand over the Python API for each job.

    approxbp fit relu-sum|invact --activation NAME_OR_EXPR …   fit one table (approxbp.fitting)
    approxbp sweep --activation A … --bits 1-4                  ReLU-sum tables over activations × k × objectives
    approxbp reproduce [--full] [--memory]                      the papers' rows beside ours, one verdict
    approxbp export [TABLE …] [--out-dir DIR]                   Triton kernel modules from tables
    approxbp tables [FILE …] [--family F]                       list and validate tables
    approxbp certify [TABLE …] [--write]                        rigorous error bounds (interval arithmetic)
    approxbp cost [TABLE …] [--dtype D]                         the kernels' GPU cost, offline, against the H100 budget
    approxbp plan MODEL [--budget 24GiB] [--use …]              a training step's memory and a replacement per layer
    approxbp figures | atlas | bdia analyze|train-toy           the docs' figures, the error atlas, BDIA

Each subcommand is a module of :mod:`approxbp.commands` (its parser beside its handler); only the parser of the
command being run is built, so a command imports only what it needs.
"""

from __future__ import annotations

import argparse
import sys

from approxbp import __version__
from approxbp.commands import atlas, bdia, certify, cost, export, figures, fit, plan, reproduce, sweep, tables

__all__ = ["build_parser", "COMMANDS", "main"]


#: name → its module (``add_parser(sub, add)``, ``run(args, argv)``), in the order of ``approxbp --help``
COMMANDS = {"fit": fit, "sweep": sweep, "reproduce": reproduce, "export": export, "figures": figures, "atlas": atlas,
            "bdia": bdia, "cost": cost, "plan": plan, "certify": certify, "tables": tables}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand, or of ``only`` that one (what :func:`main` builds to run it)."""
    fmt = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(prog="approxbp", description=__doc__.split("\n")[0], formatter_class=fmt)
    parser.add_argument("--version", action="version", version=f"approxbp {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def add(parent, name, **kw):
        return parent.add_parser(name, formatter_class=fmt, **kw)

    for name, command in COMMANDS.items():
        if only in (None, name):
            command.add_parser(sub, add)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv[0] if argv and argv[0] in COMMANDS else None).parse_args(argv)
    try:
        return COMMANDS[args.command].run(args, argv)
    except (ValueError, TypeError, OSError, RuntimeError) as err:
        print(f"approxbp: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # files are written atomically: an interrupted command leaves none half-written
        print("approxbp: interrupted (files are written whole or not at all)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
