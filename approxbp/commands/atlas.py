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
    atl.add_argument("--bits", default=None, metavar="K|K1-K2",
                     help="the ReLU-sum bit-widths (default 1-8 where the tables are packaged, 1-4 for an "
                          "activation fitted here: k = 5…8 take most of the time; FewBit's curves span 1-8)")
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
    bits = _bits(args.bits, named)
    written = write_atlas(figures_dir(out), tuple(named), progress=common.progress_on(args), bits=bits)
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


def _bits(text: str | None, activations) -> range:
    """``--bits`` as a range: K or K1-K2 within 1…8; default 1…8 where every table is packaged, else 1…4."""
    from approxbp.approximations import tables as table_files

    if text is None:
        stems = {p.stem for p in table_files.table_paths("relu-sum")}
        packaged = all(table_files.relu_sum_name(a.name, 8, "derivative") in stems for a in activations)
        return range(1, 9) if packaged else range(1, 5)
    lo, _, hi = str(text).partition("-")
    try:
        k1, k2 = int(lo), int(hi or lo)
    except ValueError:
        k1 = k2 = 0
    if not 1 <= k1 <= k2 <= 8:
        raise ValueError(f"--bits {text!r}: expected K or K1-K2 with 1 ≤ K1 ≤ K2 ≤ 8 (e.g. --bits 1-4)")
    return range(k1, k2 + 1)
