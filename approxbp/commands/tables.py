"""``approxbp tables``: list and validate coefficient tables."""

from __future__ import annotations

from approxbp.commands import common

__all__ = ["add_parser", "run"]


def add_parser(sub, add) -> None:
    tab = add(sub, "tables", help="list and validate coefficient tables (the packaged ones, or the files given)")
    common.table_paths_arg(tab, "the packaged ones; yours are validated", name="files")
    tab.add_argument("--family", default=None, help="only this family (a registered one: relu-sum, invact, or "
                     "another package's)")


def run(args, argv) -> int:
    from approxbp.approximations import tables as table_files
    from approxbp.approximations.families import TABLE_FAMILIES, member

    if args.family is not None:
        try:  # an unknown family is refused by name
            member(TABLE_FAMILIES, args.family, "table class")
        except KeyError as err:
            raise ValueError(err.args[0]) from None
    paths = args.files or table_files.table_paths(args.family)
    bad = 0
    for p in paths:
        try:
            t = table_files.load(p)
        except (ValueError, OSError) as err:
            print(f"INVALID {err}")
            bad += 1
            continue
        if args.family and t.family != args.family:
            continue
        extra = t.summary()
        name = table_files.packaged_name(p)
        shown = f"{name}.json" if name else p
        print(f"{shown!s:<48} {t.source:<5} {extra}")
    print(f"{len(paths)} tables, " + (f"{bad} invalid" if bad else "all valid"))
    return 2 if bad else 0
