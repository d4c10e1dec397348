"""``approxbp fit toy-step``: the CLI's part of the toy family."""

from __future__ import annotations

from pathlib import Path

from approxbp.approximations.families import register

from approxbp.commands.fit import FITS, FitCommand


def arguments(parser) -> None:
    parser.add_argument("--activation", required=True, help="registry name or an expression in x")
    parser.add_argument("--interval", type=float, nargs=2, default=(-4.0, 4.0), metavar=("A", "B"))
    parser.add_argument("--out", type=Path, default=None, help="table path (None: print only)")
    parser.add_argument("--force", action="store_true", help="with --out: replace an existing file")


def run(args, argv) -> int:
    from approxbp.approximations import tables as table_files
    from approxbp.approximations.activations import get_activation

    from .fit import fit_toy_step

    table = fit_toy_step(get_activation(args.activation), args.interval)
    print(f"toy-step · {table.activation} · {table.summary()}")
    if args.out:
        print(f"  wrote {table_files.save(table, args.out, overwrite=args.force)}")
    return 0


register(FITS, "toy-step", FitCommand("h̃′ = a for x < 0, b for x ≥ 0 (a toy family)", arguments, run))
