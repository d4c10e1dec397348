"""``approxbp export``: Triton kernel modules generated from tables."""

from __future__ import annotations

from pathlib import Path

from approxbp.commands import common

__all__ = ["add_parser", "run"]


def add_parser(sub, add) -> None:
    exp = add(sub, "export", help="generate Triton kernel modules from relu-sum and invact tables")
    common.table_paths_arg(exp, "every packaged relu-sum and invact table, into the package")
    exp.add_argument("--out-dir", type=Path, default=None,
                     help="None: the package's kernels/generated/ for packaged tables, <table folder>/_generated/ "
                          "for your own (where ReLUSumActivation/InvActivation look for them)")


def run(args, argv) -> int:
    from approxbp.kernels.codegen import export  # the top layer (approxbp/) may use both sides

    written = export(args.tables or None, args.out_dir)
    for folder in sorted({str(p.parent) for p in written}):
        print(f"wrote {sum(str(p.parent) == folder for p in written)} kernel modules under {folder}")
    return 0
