"""Fitting inverted-activation approximations q(y) ≈ f'(f⁻¹(y)) (Inverted Activations §2, App. A.2).

  paper    the published forms and coefficients, measured
  refit    the same forms refitted: least squares (L2) and minimax (L∞, Lawson-style IRLS)
  newton   our form: √t-rational initial guess for f⁻¹ plus exact Newton steps (invact_forms.newton_form):
           the accuracy reference (L∞ 8e-9 … 3e-6 on the packaged tables); for an increasing activation, one
           branch from a fitted guess (fitting.invact_fitted), which needs no closed-form inverse
  fast     ours for kernels (fitting.invact_fast, the default): one rational in the signed root ±√(y − f(T))
           for both branches plus a y·poly(log(−y)) left tail; L∞ ≤ 1e-6, one √ and one log per element
  sr       symbolic regression (fitting.symbolic), constants refitted in float64
  exact    derived in closed form (fitting.invact_exact): ReLU², and increasing activations (softplus,
           squareplus), which have one branch and need no bit
  auto     exact where it applies, the one-branch newton form for an increasing activation whose inverse has no
           closed form, else fast (the default)
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace

import numpy as np
from approxbp.approximations import Activation, get_activation
from approxbp.approximations import tables as table_files
from approxbp.approximations.invact import InvertedActivation, check_branch
from approxbp.approximations.invact_forms import (
    RIGHT_SPAN,
    Form,
    branch_grid,
    branch_metrics,
    newton_form,
    published_forms,
    right_tail_error,
)
from scipy.optimize import least_squares

from .relu_sum import package_version
from .result import FitResult

__all__ = ["fit_invact", "FORMS", "invact_table", "refit", "verdict_of"]


FORMS = ("auto", "paper", "released", "refit-l2", "refit-linf", "newton", "sr", "fast", "exact")


def refit(ia: InvertedActivation, form: Form, branch: str, norm: str = "l2", iterations: int = 30) -> Form:
    """Refit a form's coefficients in float64 on the branch grid: least squares, or minimax by IRLS."""
    if norm not in ("l2", "linf"):
        raise ValueError(f"norm must be 'l2' or 'linf', got {norm!r}")
    yv, w = branch_grid(ia, check_branch(branch), 4001)
    g = ia.g(yv, branch)
    names = list(form.coefficients)
    sw = np.sqrt(w / w.sum())

    def residual(p, weights):
        r = (form(yv, dict(zip(names, p))) - g) * weights
        return np.nan_to_num(r, nan=1e3, posinf=1e3, neginf=-1e3)

    p0 = np.array(list(form.coefficients.values()))
    p = least_squares(residual, p0, args=(sw,), method="lm", xtol=1e-15, ftol=1e-15, gtol=1e-15).x
    if norm == "linf":  # start from the given coefficients; keep the best iterate (the start included)
        p = p0
        weights, best = sw.copy(), (np.max(np.abs(form(yv) - g)), p0)
        for _ in range(iterations):
            p = least_squares(residual, p, args=(weights,), method="lm", xtol=1e-15, ftol=1e-15).x
            err = np.abs(form(yv, dict(zip(names, p))) - g)
            best = min(best, (err.max(), p), key=lambda b: b[0])
            weights = np.sqrt(weights**2 * err / err.max() + 1e-12)
        p = best[1]
    return replace(form, coefficients=dict(zip(names, map(float, p))))


def _fit_newton(ia: InvertedActivation, branch: str, degree: int = 4, steps: int = 1) -> Form:
    """Our form: fit the initial guess |x − T| ≈ s·P(s)/Q(s) (s = √t) to the exact inverse by linearised
    rational least squares, refined for relative error; the Newton step(s) then square the error."""
    yv, _ = branch_grid(ia, check_branch(branch), 4001)
    keep = slice(1, -1)  # drop the turning point (δ = 0) and the open left end (x = −∞)
    yv = yv[keep]
    s = np.sqrt(ia.t_of(yv))
    delta = np.abs(ia.inverse(yv, branch) - ia.T)
    # δ/s = P(s)/Q(s)  ⇒  P(s) − (δ/s)(Q(s) − 1) = δ/s, linear in (p, r); relative weighting 1/(δ/s)
    target = delta / s
    A = np.hstack([s[:, None] ** np.arange(degree + 1), -target[:, None] * s[:, None] ** np.arange(1, degree + 1)])
    wrel = 1 / target
    coef = np.linalg.lstsq(A * wrel[:, None], target * wrel, rcond=None)[0]
    form = newton_form(ia, branch, degree, steps)
    names = list(form.coefficients)
    tail = len(names) - coef.size  # the left branch's w-terms start at 0
    wv = -np.log1p(-ia.t_of(yv) / (ia.left_limit - ia.f_T)) if tail else None

    def rel(c):
        P = np.polyval(c[: degree + 1][::-1], s)
        Q = 1 + s * np.polyval(c[degree + 1: 2 * degree + 1][::-1], s)
        d = s * P / Q + ((c[-2] * wv + c[-1] * np.sqrt(wv) * s) if tail else 0.0)
        return (d - delta) / delta

    coef = least_squares(rel, np.concatenate([coef, np.zeros(tail)]), method="lm", xtol=1e-15, ftol=1e-15).x
    return replace(form, coefficients=dict(zip(names, map(float, coef))))


def invact_table(activation: str | Activation, left: Form, right: Form, form: str, source: str = "fit",
                 reference: str | None = None, provenance: dict | None = None, extra: dict | None = None,
                 combined: Form | None = None) -> table_files.InvActTable:
    """An invact table with measured metrics for both branches (and the ``combined`` q(y, b), if given)."""
    ia = InvertedActivation(get_activation(activation))
    linf_l, l2_l = branch_metrics(ia, left, "left")
    linf_r, l2_r = branch_metrics(ia, right, "right")
    linf_r = max(linf_r, right_tail_error(ia))  # the right branch's rule includes the tail rule q = h′(y)
    return table_files.InvActTable.new(
        ia.activation, source=source, form=form, turning_point=ia.T, f_T=ia.f_T, left=left.to_json(ia.domain("left")),
        right=right.to_json((ia.f_T, ia.f_T + 10.0)), combined=None if combined is None else combined.to_json(),
        metrics={"linf_left": linf_l, "l2_left": l2_l, "linf_right": linf_r, "l2_right": l2_r, **(extra or {})},
        provenance={"method": form, "seed": None, "command": "approxbp.fitting.invact",
                    "package_version": package_version(), "seconds": 0.0, **(provenance or {})},
        reference=reference)


#: Largest |h′(y) − f′(f⁻¹(y))| allowed beyond the right domain, where the drop-ins use q = h′(y).
_TAIL_TOL = 1e-6


def _check_right_tail(ia: InvertedActivation) -> float:
    """Measure the drop-ins' tail rule q = h′(y) for y > f(T) + RIGHT_SPAN (up to 1e6) against the exact g;
    refuse the activation when it errs by more than :data:`_TAIL_TOL`. Returns the error."""
    y_max = ia.f_T + RIGHT_SPAN
    err = right_tail_error(ia)
    if not err <= _TAIL_TOL:
        act = ia.activation
        raise ValueError(f"activation {act.name!r}: beyond y = {y_max:.6g} the inverted-activation kernels use "
                         f"q = h′(y), which errs by {err:.3g} > {_TAIL_TOL:g} here (f⁻¹(y) − y does not vanish fast "
                         f"enough); this family does not suit it. A way forward: {act.relu_sum_way_forward()}")
    return err


_NEWTON_DEFAULTS = {"left": (3, 2), "right": (4, 1)}  # (rational degree, Newton steps), chosen by measurement


def fit_invact(activation: str = "gelu", form: str = "auto", seed: int = 0,
               backend: str = "pyoperon", sr_generations: int = 150, progress: bool = True) -> FitResult:
    """Build a table for one activation and form (see the module docstring); the :class:`~.result.FitResult`
    holds it as ``table``, its worse branch L∞ as ``fun``."""
    table = _invact_table(activation, form, seed, backend, sr_generations, progress)
    worst = max(table.metrics[f"linf_{b}"] for b in table.branches)
    success, verdict = verdict_of(table.form, worst)
    return FitResult(table=table, fun=worst, success=success, seconds=table.provenance.get("seconds"),
                     message=f"{table.name}: L∞ " + ", ".join(f"{table.metrics[f'linf_{b}']:.3g} ({b})"
                                                              for b in table.branches) + f"; {verdict}")


#: The L∞ the exact form promises per branch: the float64 floor.
_EXACT_FLOOR = 1e-12


def verdict_of(form: str, worst: float) -> tuple[bool, str]:
    """(success, why): the fit's own verdict on the worse branch's L∞ ``worst`` — finite, and within what the form
    promises where it promises a number (fast, the kernels' form: its tolerance ``invact_fast.TOL``; exact: the
    float64 floor); the other forms (published, refitted, symbolic regression, Newton) promise none."""
    from .invact_fast import TOL

    promised = {"fast": TOL, "exact": _EXACT_FLOOR}.get(form)
    if not np.isfinite(worst):
        return False, "failed: the error is not finite on the measuring grid"
    if promised is None:
        return True, f"the {form} form promises no bound: finite on the measuring grid"
    if worst <= promised:
        return True, f"within the {form} form's promised L∞ {promised:g}"
    return False, f"failed: over the {form} form's promised L∞ {promised:g}"


def _refuse_piecewise(act) -> None:
    """The fitted forms expand h at its turning point and bound h″: a kink breaks both. Refused, with the family
    that fits it."""
    from .invact_exact import takes_exact

    if not act.kinks():
        return
    kinks = ", ".join(f"{k:g}" for k in act.kinks())
    if takes_exact(act):  # ReLU², ELU: the exact table is the form for it
        raise ValueError(f"activation {act.name!r} is piecewise (kinks at x = {kinks}): the fitted InvAct forms need "
                         f"a smooth h; its exact table serves it: {act.fit_command('invact', '--form exact')}")
    raise ValueError(f"activation {act.name!r} is piecewise (kinks at x = {kinks}) and not increasing: the fitted "
                     "InvAct forms need a smooth h, and an exact two-branch table of its pieces is not implemented. "
                     f"A way forward: {act.relu_sum_way_forward()}")


def _say(form: str, t0: float):
    """A progress line on stderr with the seconds since ``t0``."""
    return lambda line: print(f"[fit invact {form}] {line} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr,
                              flush=True)


def _one_branch(act, form: str, progress: bool, t0: float) -> table_files.InvActTable | None:
    """The exact table (``exact``; ``auto`` where it applies: monotone, ReLU², constant pieces) or, for an increasing
    activation, the fitted one-branch form (``newton``; ``auto`` when its inverse has no closed form); None when the
    two-branch forms serve ``act``."""
    from .invact_exact import NoClosedForm, exact_table, is_monotone, takes_exact
    from .invact_fitted import fitted_monotone_table, takes_fitted

    def fitted():
        return fitted_monotone_table(act, say=_say("newton", t0) if progress else None)

    if form == "newton" and is_monotone(act) and not act.kinks():  # one branch: fitted guess + Newton steps
        return fitted()
    if form == "exact" or (form == "auto" and takes_exact(act)):
        try:
            return exact_table(act)
        except NoClosedForm as refused:
            if not takes_fitted(act):
                raise
            if form == "exact":
                raise NoClosedForm(refused.reason, act, fitted=True) from None
            return fitted()
    return None


def _fast_table(act, ia: InvertedActivation, progress: bool, t0: float) -> table_files.InvActTable:
    """The fast form's table (:func:`.invact_fast.fast_form`), measured on wide grids of both tails; raises
    :class:`.invact_fast.NoFastForm` when no degree reaches the tolerance there."""
    from .invact_fast import TOL, NoFastForm, branch, fast_form, fused_operations

    say = _say("fast", t0) if progress else None
    say and say("fitting the rational in the signed root and the left tail, 3 splits")
    combined, info = fast_form(ia, say=say)
    left, right = branch(combined, "left"), branch(combined, "right")
    trans, other = fused_operations(combined)
    yl = np.concatenate([np.linspace(ia.f_T, 0.0, 40001)[:-1], -np.geomspace(1e-300, 1e-2, 2000)])
    yr = np.concatenate([np.linspace(ia.f_T, ia.f_T + 30.0, 60001), np.geomspace(30.0, 1e4, 2000)])
    info["linf_everywhere"] = wide = max(float(np.max(np.abs(f(v) - ia.g(v, side))))
                                         for f, v, side in ((left, yl, "left"), (right, yr, "right")))
    if not wide <= TOL:
        raise NoFastForm(f"the fast form errs by {wide:.3g} > {TOL:g} somewhere in the tails", act)
    prov = {"method": f"fast: rational minimax in the signed root σ = ±√(y − f(T)) (degree "
                      f"{info['rational_degree']}) + y·poly(log(−y)) left tail (degree {info['tail_degree']})",
            "seconds": round(time.perf_counter() - t0, 2)}
    extra = {"fast": {**info, "tolerance": TOL, "transcendental_ops": trans, "other_ops": other}}
    return invact_table(act, left, right, "fast", provenance=prov, extra=extra, combined=combined)


def _invact_table(activation, form, seed, backend, sr_generations, progress) -> table_files.InvActTable:
    t0, act = time.perf_counter(), get_activation(activation)
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    if (one_branch := _one_branch(act, form, progress, t0)) is not None:
        return one_branch
    auto, form = form == "auto", "fast" if form == "auto" else form
    _refuse_piecewise(act)
    ia = InvertedActivation(act)
    _check_right_tail(ia)
    extra, combined, fallback = None, None, ""  # combined: the fast form's one q(y, b) for both branches
    if form == "fast":
        from .invact_fast import NoFastForm

        try:
            return _fast_table(act, ia, progress, t0)
        except NoFastForm as refused:
            if not auto:
                raise
            print(f"[fit invact auto] {refused.reason}: falling back to --form newton "
                  f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
            form, fallback = "newton", f"--form auto: no fast form ({refused.reason}), so "
    if form in ("paper", "released"):
        forms = published_forms(act.name, ia)
        if form not in forms:
            raise ValueError(f"no {form!r} form is published for {act.name!r}; available: {list(forms)}")
        left, right, ref = forms[form]
        return invact_table(act, left, right, form, source="paper", reference=ref,
                            provenance={"command": f"approxbp fit invact --activation {act.name} --form {form}"})
    if form.startswith("refit"):
        left0, right0, ref = published_forms(act.name, ia)["paper"]
        norm = form.split("-")[1]
        left, right = refit(ia, left0, "left", norm), refit(ia, right0, "right", norm)
        how = ", IRLS minimax" if norm == "linf" else ""
        prov = {"method": f"{form} of the paper's forms (scipy least_squares{how})"}
    elif form == "newton":
        left, right = (_fit_newton(ia, b, *_NEWTON_DEFAULTS[b]) for b in ("left", "right"))
        prov = {"method": f"{fallback}newton: √t-rational initial guess (degree, steps) = "
                          f"{_NEWTON_DEFAULTS} + damped exact Newton steps"}
    else:
        from .symbolic import fit_branch_sr

        left, lfront = fit_branch_sr(ia, "left", backend=backend, seed=seed, generations=sr_generations)
        right, rfront = fit_branch_sr(ia, "right", backend=backend, seed=seed, generations=sr_generations)
        prov = {"method": f"symbolic regression ({backend}, {sr_generations} generations), constants refitted "
                          "in float64", "seed": seed}
        extra = {"pareto_left": lfront, "pareto_right": rfront}
    prov["seconds"] = round(time.perf_counter() - t0, 2)  # the fit itself; measuring the metrics comes after
    return invact_table(act, left, right, form, provenance=prov, extra=extra, combined=combined)
