"""Symbolic regression of g = f'∘f⁻¹ on one branch, behind a small backend interface.

Backends: ``pyoperon`` (pip, C++ engine, offline; the default) and ``pysr`` (optional; needs Julia).
The regression variable is s = √((y − f(T))/t_max) ∈ [0, 1], so the turning point's √ behaviour is a
linear term. pyoperon's PyPI build computes in single precision: every structure on the Pareto front
gets its constants refitted in float64 (scipy least squares, its Jacobian sympy's derivatives) before it is
measured.
"""

from __future__ import annotations

import importlib.util
import re
import shutil

import numpy as np
import sympy as sp
from approxbp.approximations.backends import grammar
from approxbp.approximations.expressions import parse as parse_expression
from approxbp.approximations.invact import InvertedActivation
from approxbp.approximations.invact_forms import RIGHT_SPAN, Form, branch_grid, branch_metrics, y
from scipy.optimize import least_squares

__all__ = ["BACKENDS", "BackendUnavailable", "check_backend", "fit_branch_sr", "pick_form"]


#: What the SR engines print beyond the form grammar (pyoperon: infix with exp/log/sqrt, square, pow; PySR:
#: sympy-style names).
_SR_SYNTAX = {"square": lambda a: a**2, "pow": sp.Pow}


def _sr_functions() -> dict:
    """The names an SR expression may use: the form grammar (:func:`~approxbp.approximations.backends.grammar`)
    and the engines' own syntax."""
    return {**grammar("form"), **_SR_SYNTAX}

BACKENDS = ("pyoperon", "pysr")


class BackendUnavailable(RuntimeError):
    """The chosen symbolic-regression backend cannot run here; the message says why and what to do."""


def check_backend(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    if name == "pyoperon" and importlib.util.find_spec("pyoperon") is None:
        raise BackendUnavailable("pyoperon is not installed: pip install 'approxbp[sr]'")
    if name == "pysr":
        if importlib.util.find_spec("pysr") is None:
            raise BackendUnavailable("PySR is not installed: pip install 'approxbp[pysr]' (it also needs Julia)")
        if shutil.which("julia") is None:
            raise BackendUnavailable(
                "PySR needs a Julia installation, and none is on PATH (PySR downloads one on first use, "
                "which needs network access). Use --backend pyoperon, which runs offline.")
    return name


def _samples(ia: InvertedActivation, branch: str, n: int = 1500):
    yv, _ = branch_grid(ia, branch, n)
    yv = yv[:-1] if branch == "left" else yv  # the open left end
    t_max = (ia.left_limit - ia.f_T) if branch == "left" else RIGHT_SPAN
    t = np.maximum(ia.t_of(yv), 0.0)  # y − f(T) rounds to −1e-17 at the turning point (NaN under the root)
    return np.sqrt(t / t_max), ia.g(yv, branch), t_max


def _pyoperon(s, g, seed: int, generations: int) -> list[str]:
    """One thread and a generation budget (no wall-clock limit): the same seed gives the same front."""
    from pyoperon.sklearn import SymbolicRegressor

    reg = SymbolicRegressor(allowed_symbols="add,sub,mul,div,constant,variable,exp,log,sqrt",
                            population_size=1000, generations=generations, max_length=40, objectives=["r2", "length"],
                            n_threads=1, random_state=seed, max_time=10**9, optimizer_iterations=10)
    reg.fit(s[:, None], g)
    models = [reg.get_model_string(p["tree"], 17, ["s"]) for p in reg.pareto_front_]
    return [m.replace("^", "**") for m in models]


def _pysr(s, g, seed: int, generations: int) -> list[str]:  # pragma: no cover - needs Julia
    from pysr import PySRRegressor

    reg = PySRRegressor(binary_operators=["+", "-", "*", "/"], unary_operators=["exp", "log", "sqrt"],
                        niterations=generations, random_state=seed, deterministic=True, procs=0,
                        variable_names=["s"])
    reg.fit(s[:, None], g)
    return [str(e) for e in reg.equations_["sympy_format"]]


def _refit_constants(expr: sp.Expr, s_var: sp.Symbol, s, g) -> tuple[sp.Expr, dict[str, float]]:
    """Replace every numeric constant by a coefficient c0, c1, … and refit them in float64."""
    floats = sorted({a for a in expr.atoms(sp.Float)}, key=lambda f: str(f))
    if not floats:
        return expr, {}
    syms = sp.symbols(f"c0:{len(floats)}")
    template = expr.xreplace(dict(zip(floats, syms)))
    fn = sp.lambdify([s_var, *syms], template, "numpy")
    value_and_grad = sp.lambdify([s_var, *syms], [template, *(sp.diff(template, c) for c in syms)], "numpy",
                                 cse=True)

    def res(p):
        with np.errstate(all="ignore"):
            r = np.broadcast_to(fn(s, *p), s.shape) - g
        return np.nan_to_num(r, nan=1e3, posinf=1e3, neginf=-1e3)

    def jac(p):
        """∂r/∂c from sympy's derivative; 0 where r is clamped (a non-finite value does not move)."""
        with np.errstate(all="ignore"):
            value, *columns = (np.broadcast_to(col, s.shape) for col in value_and_grad(s, *p))
            d = np.stack(columns, axis=1)
        return np.where(np.isfinite(value)[:, None] & np.isfinite(d), d, 0.0)

    p = least_squares(res, np.array([float(f) for f in floats]), jac=jac, method="lm", xtol=1e-15, ftol=1e-15).x
    return template, {k.name: float(v) for k, v in zip(syms, p)}


def fit_branch_sr(ia: InvertedActivation, branch: str, backend: str = "pyoperon", seed: int = 0,
                  generations: int = 150) -> tuple[Form, list[dict]]:
    """Run SR on one branch; return the most accurate refitted form and the Pareto front
    [{complexity, linf, l2, expression}] (expressions in y, constants substituted)."""
    check_backend(backend)
    s, g, t_max = _samples(ia, branch)
    raw = (_pyoperon if backend == "pyoperon" else _pysr)(s, g, seed, generations)
    s_var = sp.Symbol("s")
    s_of_y = sp.sqrt((y - sp.Float(ia.f_T, 17)) / sp.Float(t_max, 17))
    front, best = [], None
    for text in raw:
        try:
            expr = parse_expression(re.sub(r"\bX1\b", "s", text), {**_sr_functions(), "s": s_var}, "SR expression",
                                    exact=False)
        except ValueError:
            continue  # outside the grammar (never evaluated)
        template, coeffs = _refit_constants(expr, s_var, s, g)
        form = Form(template.xreplace({s_var: s_of_y}), coeffs)
        try:
            linf, l2 = branch_metrics(ia, form, branch)
        except ValueError:
            continue  # not finite somewhere on the branch
        front.append({"complexity": int(sp.count_ops(template)), "linf": linf, "l2": l2,
                      "expression": str(form.substituted())})
        if best is None or linf < best[0]:
            best = (linf, form)
    if best is None:
        raise RuntimeError(f"symbolic regression found no finite expression on the {branch} branch")
    return best[1], sorted(front, key=lambda e: e["complexity"])


def pick_form(table: dict, branch: str, index: int) -> Form:
    """Member ``index`` of a symbolic-regression table's Pareto front on ``branch`` (as printed by
    ``approxbp fit invact --form sr``), as a Form: ``.substituted()`` is its sympy expression, ``.latex()``
    its LaTeX, ``.torch_fn()`` a PyTorch callable. Put it in a table with ``approxbp.fitting.invact``."""
    front = table.metrics.get(f"pareto_{branch}")
    if front is None:
        raise ValueError(f"table has no Pareto front for the {branch} branch (only --form sr tables do)")
    if not 0 <= index < len(front):
        raise ValueError(f"index must be in 0..{len(front) - 1}, got {index}")
    return Form.parse(front[index]["expression"])  # a Pareto-front entry, not a table
