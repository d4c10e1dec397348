"""``approxbp fit FAMILY`` (relu-sum, invact, or another registered family, :data:`FITS`): one table fitted,
summarised, written to ``--out``."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from approxbp.approximations.families import Registry, register
from approxbp.commands import common

__all__ = ["add_parser", "FitCommand", "FITS", "run"]


@dataclass(frozen=True)
class FitCommand:
    """The CLI's part of a table family (:mod:`approxbp.approximations.families`): ``approxbp fit FAMILY``'s help,
    its arguments (``arguments(parser)``, building no more than argparse: no torch, scipy or sympy) and its run
    (``run(args, argv) → exit status``, after ``--out`` was checked writable)."""

    help: str
    arguments: Callable
    run: Callable


def add_parser(sub, add) -> None:
    fit = add(sub, "fit", help="fit an approximation family and write a coefficient table")
    fam = fit.add_subparsers(dest="family", required=True)
    for family, command in FITS.items():
        command.arguments(add(fam, family, help=command.help))


def _relu_sum_arguments(rs) -> None:
    from approxbp.commands.choices import METHODS, OBJECTIVES

    rs.add_argument("--activation", required=True, help="registry name or an expression in x")
    rs.add_argument("--name", default=None, help="a label for an expression (tables, reports, file names); "
                    "None: the expression itself")
    rs.add_argument("--bits", type=int, required=True, help="k: 2^k−1 ReLUs, k-bit codes (1..8)")
    rs.add_argument("--objective", choices=OBJECTIVES, default=None,
                    help="primitive: ∫(h−h̃)² (eq. 14); derivative: ∫(h'−h̃')² (eq. 63). Default: primitive, "
                    "derivative with --levels free")
    rs.add_argument("--levels", choices=("constrained", "free"), default="constrained",
                    help="constrained: eq. 13 (Σw = 1, Σw·c = 0, the interval by the tail rule); free: FewBit's "
                    "family (every level free, uniform weight on --interval or --weight's p on its own interval; "
                    "derivative objective only)")
    rs.add_argument("--interval", type=float, nargs=2, metavar=("A", "B"), default=None,
                    help="the domain: with --levels free FewBit's -100 100 by default; constrained: in place of the "
                    "tail rule's interval (the mass outside it is reported in the table, not fitted)")
    rs.add_argument("--weight", default=None, metavar="normal:σ",
                    help="weight the objective by the density of what the model feeds the activation: "
                    "∫(h−h̃)²p or ∫(h'−h̃')²p with p = N(0, σ²) (a 1e-3 uniform share on ±9σ, the interval); "
                    "the summary then gives the gradient error under p beside the packaged uniform table's")
    rs.add_argument("--method", choices=("auto", *METHODS), default="auto",
                    help="auto = anneal for k ≤ 4, polish above; every method ends in the certified polish")
    rs.add_argument("--out", type=Path, default=None, help="table path (None: print only)")
    rs.add_argument("--force", action="store_true", help="with --out: replace an existing file")
    common.add_common(rs)


def _invact_arguments(inv) -> None:
    from approxbp.commands.choices import BACKENDS, FORMS

    inv.add_argument("--activation", required=True, help="registry name or an expression in x")
    inv.add_argument("--name", default=None, help="a label for an expression (tables, reports, file names); "
                     "None: the expression itself")
    inv.add_argument("--form", default="auto", choices=FORMS,
                     help="auto: exact where it applies, else fast; fast: ours for kernels (≤ 1e-6, one √ and one "
                          "log); newton: ours, the accuracy reference; paper/released: published (gelu, silu); "
                          "refit-*: their forms refitted; sr: symbolic regression; exact: derived in closed form for "
                          "an increasing activation (one branch, no bit: softplus q = 1 − e^(−y)) or one flat left of "
                          "0 (relu2: q = 2√y)")
    inv.add_argument("--backend", choices=BACKENDS, default=BACKENDS[0], help="with --form sr")
    inv.add_argument("--sr-generations", type=int, default=150,
                     help="with --form sr: generations per branch (a count, not a time, so the result is reproducible)")
    inv.add_argument("--seed", type=int, default=0, help="with --form sr: the search's seed")
    inv.add_argument("--out", type=Path, default=None, help="table path (None: print only)")
    inv.add_argument("--force", action="store_true", help="with --out: replace an existing file")
    common.no_progress(inv)


def run(args, argv) -> int:
    """``approxbp fit FAMILY``: one table, summarised; written to --out (checked before the fit)."""
    from approxbp.approximations.files import check_writable

    if args.out is not None:  # fail now, not after a long fit
        check_writable(args.out, overwrite=args.force)
    return FITS[args.family].run(args, argv)


def _fit_relu_sum(args, argv) -> int:
    from approxbp.approximations import tables as table_files
    from approxbp.approximations.activations import named_activation
    from approxbp.fitting.relu_sum import cli_command, fit_relu_sum
    from approxbp.fitting.weights import Weight

    progress = common.progress_on(args)
    args.objective = args.objective or "primitive"
    weight = Weight.parse(args.weight) if args.weight else None
    fit = fit_relu_sum(named_activation(args.activation, args.name), args.bits, args.objective,
                       method=args.method, restarts=args.restarts, seed=args.seed, workers=args.workers,
                       progress=progress, command=cli_command(argv), interval=args.interval, weight=weight)
    table = fit.table
    print(_summary(table, timed=not progress))
    print(f"  restarts    {fit.message}")
    for line in _gradient_errors(table, weight):
        print(line, file=sys.stderr if line.startswith("approxbp: warning") else sys.stdout)
    if fit.untrusted:
        print(f"approxbp: warning: only 1 of {len(fit.restarts)} restarts reached the best loss; "
              "run more --restarts before trusting this optimum", file=sys.stderr)
    if args.out:
        print(f"  wrote       {table_files.save(table, args.out, overwrite=args.force)}")
    return 0


def _fit_invact(args, argv) -> int:
    from approxbp.approximations import tables as table_files
    from approxbp.approximations.activations import named_activation
    from approxbp.approximations.table_checks import UNBOUNDED_BELOW

    progress = common.progress_on(args)
    from approxbp.fitting.invact import fit_invact

    table = fit_invact(named_activation(args.activation, args.name), args.form, seed=args.seed,
                       backend=args.backend,
                       sr_generations=args.sr_generations, progress=progress).table
    m = table.metrics
    floor = "−∞ (no clamp)" if table.f_T == UNBOUNDED_BELOW else f"{table.f_T:.17g}"
    print(f"invact · {table.activation} · form={table.form} · "
          + ("monotone: one branch, no bit · inf f = " if table.monotone else
             f"T={table.turning_point:.17g} · f(T)=") + floor)
    for side in table.branches:
        q = textwrap.shorten(getattr(table, side).expression, 70, placeholder=" …")  # cut at a space, not mid-token
        print(f"  {side:<5} L∞ {m[f'linf_{side}']:.3e}  L2 {m[f'l2_{side}']:.3e}  "
              f"{getattr(table, side).operations} operations  q = {q}")
    for branch in [b for b in ("left", "right") if f"pareto_{b}" in m]:
        print(f"  Pareto front ({branch}; pick one with approxbp.fitting.symbolic.pick_form):")
        for i, e in enumerate(m[f"pareto_{branch}"]):
            print(f"    [{i:2}] complexity {e['complexity']:3}  L∞ {e['linf']:.3e}  "
                  f"{textwrap.shorten(e['expression'], 80, placeholder=' …')}")  # Pareto entry, not a table
    if args.out:
        print(f"  wrote {table_files.save(table, args.out, overwrite=args.force)}")
    return 0


def _fit_free_levels(args, argv) -> int:
    """``approxbp fit relu-sum --levels free``: FewBit's family, with FewBit's own table where it has one."""

    from approxbp.approximations.activations import named_activation
    from approxbp.fitting.free_levels import FEWBIT_INTERVAL, fewbit_reference, fit_free_levels
    from approxbp.fitting.relu_sum import cli_command
    from approxbp.fitting.weights import Weight

    if (args.objective or "derivative") != "derivative":
        raise ValueError("--levels free fits the derivative (FewBit's objective); drop --objective primitive")
    act = named_activation(args.activation, args.name)
    weight = Weight.parse(args.weight) if args.weight else None
    interval = tuple(args.interval) if args.interval else weight.interval if weight else FEWBIT_INTERVAL
    fit = fit_free_levels(act, args.bits, interval, restarts=args.restarts, seed=args.seed, weight=weight)
    loss = fit.recorded_loss()  # by quadrature split at the borders, as the table records it and FewBit's is measured
    print(f"{fit.activation} k={fit.bits} free levels on [{interval[0]:g}, {interval[1]:g}] (FewBit's family"
          + (f", weighted by p = {weight.describe()}, the interval {weight.interval_rule}" if weight else "")
          + f"): ∫(h' − q)²{'p' if weight else ''} = {loss:.10e}")
    print(f"  borders  {np.array2string(fit.borders, precision=6, max_line_width=110)}")
    print(f"  levels   {np.array2string(fit.levels, precision=6, max_line_width=110)}")
    print("  starts   " + ", ".join(f"{k} {v:.8e}" for k, v in fit.starts.items()))
    if weight is not None:
        uniform = fit_free_levels(act, args.bits, FEWBIT_INTERVAL, restarts=args.restarts, seed=args.seed)
        print(f"  under p  E_p[(q − h′)²]^½ = {weight.gradient_error(act, fit.borders, fit.levels):.4g} (this "
              f"table), {weight.gradient_error(act, uniform.borders, uniform.levels):.4g} (the uniform fit on "
              f"[{FEWBIT_INTERVAL[0]:g}, {FEWBIT_INTERVAL[1]:g}], FewBit's)")
    elif not np.any(np.abs(fit.borders) <= _TYPICAL):
        print(f"approxbp: warning: every border lies outside [−{_TYPICAL:g}, {_TYPICAL:g}] (where N(0, 4) puts 99.99 % "
              "of its mass): for inputs of that spread this table is one level, its bits spent where inputs rarely "
              f"go (the uniform weight on [{interval[0]:g}, {interval[1]:g}]); give a narrower --interval, or fit "
              "eq. 13's family to your inputs: --levels constrained --weight normal:σ (or a captured histogram)",
              file=sys.stderr)
    theirs = fewbit_reference().get((fit.activation, fit.bits))
    if theirs is not None and theirs.interval == interval:
        value = theirs.loss()
        above = value > loss * (1 + 1e-9)
        print(f"  FewBit   builtin table {value:.10e} (measured here: "
              + (f"{100 * (value - loss) / loss:.1f} % above ours, a local optimum)" if above else "ours equals it)"))
    if args.out:
        print(f"  wrote    {fit.save(args.out, cli_command(argv))} (a ReLU-sum table, levels_rule free: "
              f"approxbp export {args.out}, then tables={{…: '{args.out}'}} in patch_model)")
    return 0


#: A free-level fit with no border within ±this (4σ of N(0, 4)) is one level for typical pre-activations: warned.
_TYPICAL = 8.0


def _summary(t, timed: bool = True) -> str:
    """The one-screen summary of a fitted ReluSumTable; its time only where ``timed`` (the progress line, when
    shown, has said it: one time per fit)."""
    from approxbp.approximations.activations import get_activation
    from approxbp.approximations.expressions import readable

    m = t.metrics
    lines = [
        f"{t.family} · {t.activation} · k={t.bits} · objective={t.objective} · "
        f"interval=[{t.interval[0]:.6g}, {t.interval[1]:.6g}]",
        f"  expression  {readable(get_activation(t.expression).expr)}",
        f"  loss        {t.loss:.15e}   (tail mass outside interval {m['tail_mass']:.2e})",
        f"  interval    {m.get('interval_rule', '')}",
        *([f"  weight      p = {m['weight']}: the loss above is ∫(·)²p"] if "weight" in m else []),
        f"  knots       {_short(t.knots, 8)}",
        f"  weights     {_short(t.weights, 8)}",
        f"  levels      {_short(t.levels, 6)}",
        f"  constraints max(|Σw−1|, |Σw·c|) = {t.constraint_residual:.2e}",
        f"  certificate |∇J|∞ = {m['grad_inf_norm']:.2e}, λ_min(∇²J) = {m.get('hessian_min_eig', float('nan')):.3e}",
        f"  provenance  {t.provenance['method']}, seed {t.provenance['seed']}, --restarts "
        f"{t.provenance['restarts']}" + (f", {t.provenance['seconds']:.2f} s" if timed else ""),
    ]
    return "\n".join(lines)


def _gradient_errors(t, weight=None) -> list[str]:
    """The fit's gradient error E_N(0,1)[(h̃′ − h′)²]^½ (what a backward through it feels, whatever the objective
    fitted) beside the packaged tables of the same activation at k − 1 and with the other objective; a warning where
    this k is worse than k − 1 (at k = 2 the primitive objective is, for SiLU and Mish). With a ``weight``, the
    error under it too, beside the packaged (uniform-interval) table's of the same k and objective."""
    from approxbp.approximations.gradient_error import gradient_error

    ours = gradient_error(t)
    lines = [f"  gradient    E_N(0,1)[(h̃′ − h′)²]^½ = {ours:.4g} (this table)"]
    other = "primitive" if t.objective == "derivative" else "derivative"
    worse = None
    for label, bits, objective in ((f"k={t.bits - 1}", t.bits - 1, t.objective), (other, t.bits, other)):
        if (packaged := _packaged(t, bits, objective)) is None:
            continue
        error = gradient_error(packaged)
        lines.append(f"              {error:.4g} packaged {label} ({objective} objective, relu_sum/{packaged.name})")
        if bits == t.bits - 1 and error < ours:
            worse = error
    if len(lines) == 1:
        lines.append("              (no packaged table of this activation to compare with)")
    if weight is not None:
        under = weight.gradient_error(t.expression, t.knots, t.levels)
        lines.append(f"  under p     E_p[(h̃′ − h′)²]^½ = {under:.4g} (this table, p = {weight.describe()})")
        if (uniform := _packaged(t, t.bits, t.objective)) is not None:
            lines.append(f"              {weight.gradient_error(t.expression, uniform.knots, uniform.levels):.4g} "
                         f"packaged, fitted uniform on its interval (relu_sum/{uniform.name})")
    if worse is not None:
        lines.append(f"approxbp: warning: this k={t.bits} table's gradient error {ours:.3g} is worse than the packaged "
                     f"k={t.bits - 1}'s {worse:.3g}: the {t.objective} objective does not fit the gradient; "
                     "--objective derivative does")
    return lines


def _packaged(t, bits: int, objective: str):
    """The packaged fitted ReLU-sum table of ``t``'s activation (the same expression) at ``bits`` and ``objective``,
    or None."""
    from approxbp.approximations import tables as table_files

    path = table_files.data_dir() / "relu_sum" / f"{table_files.relu_sum_name(t.activation, bits, objective)}.json"
    if bits < 1 or not path.is_file():
        return None
    table = table_files.load(path)
    return table if table.expression == t.expression else None


def _short(values, precision: int) -> str:
    """An array on at most two lines (k ≥ 5 tables are summarised: first and last entries; the table has all)."""
    return np.array2string(np.array(values), precision=precision, max_line_width=100, threshold=16, edgeitems=3)


#: table family → its ``approxbp fit FAMILY`` (:class:`FitCommand`): the CLI's part of a family (another package's:
#: its entry point in ``approxbp.fit``)
FITS: Registry = Registry("approxbp.fit")
register(FITS, "relu-sum", FitCommand(
    "sum of 2^k−1 ReLUs (Approx-BP eq. 13)", _relu_sum_arguments,
    lambda args, argv: (_fit_free_levels if args.levels == "free" else _fit_relu_sum)(args, argv)))
register(FITS, "invact", FitCommand("f'∘f⁻¹ for inverted activations (Inverted Activations §2)", _invact_arguments,
                                    _fit_invact))
