"""``approxbp cost``: the generated kernels' GPU cost, counted offline against the H100 budget."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from approxbp.commands import common

__all__ = ["add_parser", "run"]


def add_parser(sub, add) -> None:
    from approxbp.commands.choices import DTYPES

    cst = add(sub, "cost", help="GPU cost of the generated kernels without a GPU: compile for sm_90 offline, count "
              "SASS instructions per element against the H100 budget (≈ 10.45 per byte moved)")
    common.table_paths_arg(cst, "every packaged one, the MS-norms, BDIA, the exact GLUs and the torch-like GELU/SiLU")
    cst.add_argument("--arch", default="sm_90", help="the target, sm_NN")
    cst.add_argument("--dtype", default="bf16", choices=tuple(DTYPES), help="the activation dtype")
    cst.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    common.no_progress(cst)


def run(args, argv) -> int:
    """``approxbp cost``: one row per kernel, then the kernels over 0.9 of the budget."""
    import re

    from approxbp import cost
    from approxbp.approximations.files import write_atomic

    m = re.fullmatch(r"sm_(\d+)", args.arch)
    if not m:
        raise ValueError(f"--arch {args.arch!r}: expected sm_NN, e.g. sm_90")
    tell = (lambda i, n, name: print(f"[{i}/{n}] {name}", file=sys.stderr)) if common.progress_on(args) else None
    t0 = time.perf_counter()
    results = cost.run(args.tables or None, args.dtype, int(m[1]), extras=not args.tables, progress=tell)
    print(f"{args.arch}, {args.dtype}; budget {cost.BUDGET:.2f} SASS instructions per byte moved (H100); ratio = "
          "instructions per element / (budget × bytes per element)")
    print(cost.HEADER)
    for r in results:
        print(r.row())
    over = [r.name for r in results if r.ratio > 0.9]
    print(f"{len(results)} kernels in {time.perf_counter() - t0:.1f} s; {len(over)} above 0.9 of the budget"
          + (f": {', '.join(over[:8])}{' …' if len(over) > 8 else ''}" if over else ""))
    if args.json:
        write_atomic(args.json, json.dumps(cost.as_json(results, int(m[1])), indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0
