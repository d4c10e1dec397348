"""``approxbp export``: Triton kernel modules generated from tables."""

from __future__ import annotations

from pathlib import Path

from approxbp.commands import common

__all__ = ["add_parser", "run", "source_checkout"]


def source_checkout() -> bool:
    """Whether approxbp runs from its source tree (``pyproject.toml`` beside ``kernels/``), where the packaged
    kernels are regenerated in place; an installed package is never written into."""
    from approxbp.kernels.ops.modules import GENERATED

    return (GENERATED.parent.parent / "pyproject.toml").is_file()


def add_parser(sub, add) -> None:
    exp = add(sub, "export", help="generate Triton kernel modules from relu-sum and invact tables")
    common.table_paths_arg(exp, "every packaged relu-sum and invact table, into the package (a source checkout "
                           "only; an installed package needs --out-dir)")
    exp.add_argument("--out-dir", type=Path, default=None,
                     help="None: the package's kernels/generated/ for packaged tables, <table folder>/_generated/ "
                          "for your own (where ReLUSumActivation/InvActivation look for them)")


def run(args, argv) -> int:
    from approxbp.approximations import tables as table_files
    from approxbp.kernels.codegen import export  # the top layer (approxbp/) may use both sides

    packaged = not args.tables or any(table_files.packaged_name(table_files.resolve(t)) is not None
                                      for t in args.tables)
    if args.out_dir is None and packaged and not source_checkout():
        raise ValueError("the packaged tables' kernels ship with approxbp and are not rewritten in an installed "
                         "package; give --out-dir DIR (--out-dir . for the working directory), or export a table "
                         "file of your own (its kernels go beside it)")
    written = export(args.tables or None, args.out_dir)
    for folder in sorted({str(p.parent) for p in written}):
        print(f"wrote {sum(str(p.parent) == folder for p in written)} kernel modules under {folder}")
    return 0
