"""What the subcommands share: argument helpers, the progress switch, the figures folder, a table's summary."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np


def int_in(lo: int, hi: int):
    """An argparse type: an integer in [lo, hi], refused in one line otherwise."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"{v} is outside {lo}…{hi}")
        return v

    return parse


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=0, help="root seed; restarts use independent child seeds")
    p.add_argument("--restarts", type=int, default=4, help="seeded restarts of the method (structured starts and "
                   "a knot-relocation pass come on top)")
    p.add_argument("--workers", type=int, default=None, help="processes for restarts (None: all cores)")
    no_progress(p)


def table_paths_arg(p: argparse.ArgumentParser, none: str, name: str = "tables") -> None:
    """The positional table paths of a subcommand; ``none`` says what it takes when none is given."""
    p.add_argument(name, nargs="*", type=Path, help=f"table paths (none: {none})")


def no_progress(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-progress", action="store_true", help="hide progress (bars on a terminal, lines in a log)")


def out_arg(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--out", type=Path, default=None,
                   help=f"folder for {what} (None: docs/figures of the source checkout; elsewhere required)")


def progress_on(args) -> bool:
    return not getattr(args, "no_progress", False)


def figures_dir(out: Path | None) -> Path:
    """``--out``, or the source checkout's docs/figures (never the current directory's by surprise)."""
    if out is not None:
        return out
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "docs" / "figures").is_dir() and (checkout / "pyproject.toml").is_file():
        return checkout / "docs" / "figures"
    raise ValueError("pass --out DIR: this approxbp is not a source checkout with docs/figures")


def relu_sum_summary(t) -> str:
    """The one-screen summary of a fitted ReluSumTable."""
    m = t.metrics
    lines = [
        f"{t.family} · {t.activation} · k={t.bits} · objective={t.objective} · "
        f"interval=[{t.interval[0]:.6g}, {t.interval[1]:.6g}]",
        f"  expression  {t.expression}",
        f"  loss        {t.loss:.15e}   (tail mass outside interval {m['tail_mass']:.2e})",
        f"  knots       {short(t.knots, 8)}",
        f"  weights     {short(t.weights, 8)}",
        f"  levels      {short(t.levels, 6)}",
        f"  constraints max(|Σw−1|, |Σw·c|) = {t.constraint_residual:.2e}",
        f"  certificate |∇J|∞ = {m['grad_inf_norm']:.2e}, λ_min(∇²J) = {m.get('hessian_min_eig', float('nan')):.3e}",
        f"  provenance  {t.provenance['method']}, seed {t.provenance['seed']}, "
        f"{t.provenance['restarts']} restarts, {t.provenance['seconds']:.2f} s",
    ]
    return "\n".join(lines)


def short(values, precision: int) -> str:
    """An array on at most two lines (k ≥ 5 tables are summarised: first and last entries; the table has all)."""
    return np.array2string(np.array(values), precision=precision, max_line_width=100, threshold=16, edgeitems=3)
