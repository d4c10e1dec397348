"""``approxbp tables``: list and validate coefficient tables."""

from __future__ import annotations

from approxbp.commands import common

__all__ = ["add_parser", "run"]


def add_parser(sub, add) -> None:
    from approxbp.commands.choices import FAMILIES

    tab = add(sub, "tables", help="list and validate coefficient tables (the packaged ones, or the files given)")
    common.table_paths_arg(tab, "the packaged ones; yours are validated", name="files")
    tab.add_argument("--family", default=None, choices=FAMILIES, help="only this family")


def run(args, argv) -> int:
    from approxbp.approximations import tables as T

    paths = args.files or T.table_paths(args.family)
    bad = 0
    for p in paths:
        try:
            t = T.load(p)
        except (ValueError, OSError) as err:
            print(f"INVALID {err}")
            bad += 1
            continue
        if args.family and t.family != args.family:
            continue
        extra = t.summary()
        name = T.packaged_name(p)
        shown = f"{name}.json" if name else p
        print(f"{shown!s:<48} {t.source:<5} {extra}")
    print(f"{len(paths)} tables, " + (f"{bad} invalid" if bad else "all valid"))
    return 2 if bad else 0
