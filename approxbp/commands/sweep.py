"""``approxbp sweep``: ReLU-sum tables for activations × bit-widths × objectives, each fit warm-started from the
one below it (:func:`approxbp.fitting.sweep.sweep_relu_sum`)."""

from __future__ import annotations

import time
from pathlib import Path

from approxbp.commands import common

__all__ = ["add_parser", "parse_bits", "run"]


def add_parser(sub, add) -> None:
    from approxbp.commands.choices import OBJECTIVES

    swp = add(sub, "sweep", help="fit ReLU-sum tables for several activations × bit-widths × objectives, with a "
              "summary table")
    swp.add_argument("--activation", action="append", required=True,
                     help="repeatable: a registry name or an expression (label it with NAME=EXPR)")
    swp.add_argument("--bits", default="1-4", help="bit-widths: a range 1-4 and/or a list 2,3,5")
    swp.add_argument("--objective", choices=(*OBJECTIVES, "both"), default="primitive",
                     help="the objective(s) to fit")
    swp.add_argument("--out-dir", type=Path, default=None, help="write every table here (None: print only)")
    swp.add_argument("--force", action="store_true", help="with --out-dir: replace existing tables")
    common.add_common(swp)


def run(args, argv) -> int:
    """``approxbp sweep``: every (activation, k, objective) fitted, one summary line each; tables to --out-dir."""
    from approxbp.approximations import tables as table_files
    from approxbp.approximations.activations import named_activation
    from approxbp.approximations.files import check_writable, safe_stem
    from approxbp.commands.choices import OBJECTIVES
    from approxbp.fitting.relu_sum import cli_command
    from approxbp.fitting.sweep import sweep_relu_sum

    progress, acts = common.progress_on(args), []
    for spec in args.activation:  # every name and expression parsed, and admitted by eq. 13's tails, before any fit
        name, sep, expr = spec.partition("=")
        act = named_activation(expr, name) if sep and name.isidentifier() else named_activation(spec)
        act.check_relu_sum_asymptotics()
        acts.append(act)
    bits = parse_bits(args.bits)
    objectives = OBJECTIVES if args.objective == "both" else (args.objective,)
    jobs = [(a, o, k,
             args.out_dir / f"{safe_stem(table_files.relu_sum_name(a.name, k, o))}.json" if args.out_dir else None)
            for a in acts for o in objectives for k in bits]
    for *_, path in jobs:  # fail now, not after the sweep
        if path is not None:
            check_writable(path, overwrite=args.force)
    t0 = time.perf_counter()
    print(f"{'activation':<14} {'k':>2} {'objective':<10} {'loss':>14} {'at best':>8}  {'found by':<18} {'s':>6}")
    paths, failed = {(a.name, o, k): path for a, o, k, path in jobs}, []
    for step in sweep_relu_sum(acts, bits, objectives, restarts=args.restarts, seed=args.seed, workers=args.workers,
                               progress=progress, command=cli_command(argv)):
        a, objective, k, fit = step.activation, step.objective, step.bits, step.fit
        if fit is None:
            failed.append(f"{a.name} k={k} {objective}: {' '.join(str(step.error).split())[:200]}")
            print(f"{a.name[:14]:<14} {k:>2} {objective:<10} FAILED ({type(step.error).__name__})", flush=True)
            continue
        t = fit.table
        print(f"{a.name[:14]:<14} {k:>2} {objective:<10} {t.loss:>14.6e} {fit.at_best:>3} of "
              f"{len(fit.restarts):<2}  {t.provenance['found_by'][:18]:<18} {step.seconds:>6.1f}", flush=True)
        if paths[(a.name, objective, k)] is not None:
            table_files.save(t, paths[(a.name, objective, k)], overwrite=args.force)
    print(f"{len(jobs) - len(failed)} of {len(jobs)} fits in {time.perf_counter() - t0:.1f} s"
          + (f"; tables in {args.out_dir}" if args.out_dir else ""))
    for line in failed:
        print(f"  failed: {line}")
    return 1 if failed else 0


def parse_bits(text: str) -> list[int]:
    """'1-4' → [1, 2, 3, 4]; '2,3,5' → [2, 3, 5]; '1-3,8' → [1, 2, 3, 8] (each 1…8, once, in order)."""
    from approxbp.approximations.relu_sum import check_bits

    out: list[int] = []
    for part in filter(None, text.replace(" ", "").split(",")):
        lo, sep, hi = part.partition("-")
        try:
            ks = range(int(lo), int(hi) + 1) if sep else [int(lo)]
        except ValueError:
            raise ValueError(f"--bits {text!r}: expected a range like 1-4 and/or a list like 2,3,5") from None
        out += [check_bits(k) for k in ks if k not in out]
    if not out:
        raise ValueError(f"--bits {text!r}: no bit-width")
    return out
