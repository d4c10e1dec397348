"""``approxbp atlas``: backward error against saved bits for every family."""

from __future__ import annotations

import json
from pathlib import Path

from approxbp.commands import common
from approxbp.papers.figures import figures_dir

__all__ = ["add_parser", "run"]


def add_parser(sub, add) -> None:
    atl = add(sub, "atlas", help="error atlas: backward error vs saved bits for every family (JSON + PNG)")
    atl.add_argument("--activation", action="append", default=None,
                     help="repeatable; any registry name or expression (None: gelu and silu). Missing tables are "
                          "fitted once, with a note, and kept in OUT/atlas_tables for the next atlas")
    atl.add_argument("--name", action="append", default=None,
                     help="repeatable: a label for each --activation expression, in order (titles, file names)")
    common.out_arg(atl, "error_atlas.json and the PNGs (default: the checkout's docs/figures for gelu and silu, "
                        "./atlas for --activation)")
    common.no_progress(atl)


def run(args, argv) -> int:

    from approxbp.approximations.activations import named_activation
    from approxbp.fitting.atlas import write_atlas

    acts, names = args.activation or ["gelu", "silu"], args.name or []
    if len(names) > len(acts):
        raise ValueError(f"{len(names)} --name for {len(acts)} --activation: give one label per expression")
    named = [named_activation(a, names[i] if i < len(names) else None) for i, a in enumerate(acts)]
    out = args.out
    if out is None and args.activation:  # a user's own activations: never into the checkout's docs/figures
        out = Path("atlas")
        print(f"approxbp atlas: writing into {out.resolve()} (--out DIR for another folder)", flush=True)
    written = write_atlas(figures_dir(out), tuple(named), progress=common.progress_on(args))
    rows = json.loads(written[0].read_text())["rows"]
    for act, entries in rows.items():
        print(f"{act}: L2 (N(0,1)-weighted) of the backward multiplier, per saved bit")
        for e in entries:
            family, bits = e.get("family"), e.get("bits")  # atlas result rows, not tables
            if family in ("fewbit-normal", "relu-sum-derivative") and bits <= 4 or family.startswith("invact"):
                print(f"  {e['label']:<40} {bits} bit  L2 {e['l2_normal']:.3e}  L∞ {e['linf']:.3e}")
    for p in written:
        print(f"wrote {p}")
    return 0
