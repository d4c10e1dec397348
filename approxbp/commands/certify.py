"""``approxbp certify``: rigorous bounds for tables (:func:`approxbp.fitting.certify.certify_files`)."""

from __future__ import annotations

import sys
import time

from approxbp.commands import common

__all__ = ["add_parser", "OPEN_EXIT", "budget_line", "print_certificates", "run"]


def add_parser(sub, add) -> None:
    cer = add(sub, "certify", help="rigorous error bounds (interval arithmetic, python-flint): InvAct forms' sup error "
              "over each branch, ReLU-sum objectives and global optimality for k ≤ 2")
    common.table_paths_arg(cer, "the packaged InvAct fast/newton tables and the gelu/silu ReLU-sum tables with k ≤ 2")
    cer.add_argument("--budget", type=float, default=600.0,
                     help="seconds per certificate (a branch, or a B&B); InvAct branches also stop at 300 000 boxes, "
                          "so a stored certificate does not depend on the machine")
    cer.add_argument("--max-boxes", type=int, default=None,
                     help="a work budget: boxes bounded per certificate (default: 300 000 for InvAct branches, "
                          "none for a ReLU-sum B&B); the same answer on any machine, whatever its load")
    cer.add_argument("--rtol", type=float, default=0.02,
                     help="InvAct: refine until the bound is within this factor of the error attained")
    cer.add_argument("--write", action="store_true", help="store the certificates in the tables' metrics "
                     "(then run `approxbp export` for their kernels)")
    cer.add_argument("--kernel-constants", action="store_true", help="InvAct: round the form's numbers to float32 "
                     "first, as the kernels write them (nothing is stored)")
    common.no_progress(cer)


#: ``approxbp certify``'s exit status when nothing is violated but a certificate did not close within its budget.
OPEN_EXIT = 3


def run(args, argv) -> int:
    """``approxbp certify``: one line per certificate; exit 0 when every claim holds, 1 when one fails,
    :data:`OPEN_EXIT` when none fails but one is open within its budget."""
    from approxbp.approximations import tables as table_files

    progress = common.progress_on(args)
    if not (args.budget > 0 and 0 < args.rtol < 10 and (args.max_boxes is None or args.max_boxes > 0)):
        raise ValueError("--budget and --max-boxes must be > 0 and --rtol in (0, 10)")
    t0 = time.perf_counter()
    paths = args.tables or table_files.table_paths()
    print(budget_line(args.budget, args.max_boxes), flush=True)
    held = print_certificates(paths, progress, write=args.write and not args.kernel_constants,
                              only_default=not args.tables, budget_s=args.budget, rtol=args.rtol,
                              rounded=args.kernel_constants, max_boxes=args.max_boxes)
    from approxbp.fitting.result import Verdict

    failed = [name for name, v in held.items() if v is Verdict.FAILED]
    still_open = [name for name, v in held.items() if v is Verdict.OPEN]
    weighted = [name for name, v in held.items() if v is Verdict.UNCERTIFIABLE]
    print(f"{len(held)} tables in {time.perf_counter() - t0:.1f} s: "
          + (f"FAILED: {', '.join(failed)}" if failed
             else "; ".join(([f"open within the budget (nothing violated; more --budget or --max-boxes may close "
                              f"it): {', '.join(still_open)}"] if still_open else [])
                            + ([f"not certified (a weighted fit: no budget closes it): {', '.join(weighted)}"]
                               if weighted else [])) if still_open or weighted
             else "every certificate holds (each table's lines say what it certifies)"))
    if args.write:
        print("tables updated; regenerate their kernels with `approxbp export`")
    return 1 if failed else OPEN_EXIT if still_open or weighted else 0


def budget_line(budget_s: float, max_boxes: int | None) -> str:
    """What each certificate may spend, said before the first one starts (the default is 600 s apiece)."""
    from approxbp.fitting.certify import _MAX_BOXES

    seconds = "no time limit" if budget_s == float("inf") else f"{budget_s:g} s"
    boxes = (f"{max_boxes:,} boxes" if max_boxes is not None
             else f"{_MAX_BOXES:,} boxes per InvAct branch, no box limit for a ReLU-sum branch and bound")
    return (f"budget per certificate: {seconds} or {boxes}, whichever comes first (--budget, --max-boxes; a box count "
            "gives the same answer on any machine)")


def print_certificates(paths, progress: bool, write: bool, only_default: bool = False, **options) -> dict[str, bool]:
    """Certify each table (:func:`approxbp.fitting.certify.certify_files`), printing each line as soon as its
    certificate (a branch, a bound) is done, with or without progress. Returns name → its
    :class:`~approxbp.fitting.result.Verdict` (truthy when its claims hold)."""
    from approxbp.fitting.certify import certify_files

    tell = (lambda msg: print(f"[certify] {msg}", file=sys.stderr, flush=True)) if progress else None
    held = {}
    for name, _, ok in certify_files(paths, write=write, only_default=only_default, progress=tell,
                                     emit=lambda line: print(line, flush=True), **options):
        held[name] = ok
    return held
