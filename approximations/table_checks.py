"""Semantic validation of a table's JSON object (:func:`check`): every field, the expression parsed (restricted
grammar, never evaluated) and checked against the activation's name, eq. 13's constraints for a ReLU-sum table, the
turning point, domains, forms and certificates of an InvAct table. It parses with sympy;
reading and writing tables (:mod:`.tables`) imports this module only when it validates."""

from __future__ import annotations

import functools
import json
import math

import numpy as np
import sympy as sp

from .activations import get_activation, named_expression
from .backends import numpy_namespace
from .families import TABLE_FAMILIES, member
from .files import SAFE_NAME
from .invact_forms import Form
from .relu_sum import MAX_BITS
from .table_schema import (
    CONSTRAINT_TOL,
    LEVELS_RULES,
    MAX_COEFFICIENTS,
    OBJECTIVES,
    PAPER_CONSTRAINT_TOL,
    SOURCES,
    Branch,
    TableError,
    branches_of,
    fail,
    finite,
    floats,
    kind,
    need,
    number,
    number_text,
)

__all__ = ["check", "check_invact_certified", "check_relu_sum_certified", "MONOTONE_SPAN", "not_increasing_at",
           "recorded_loss_slack", "UNBOUNDED_BELOW", "validate_invact", "validate_relu_sum"]


def check(t: dict, where: str = "<table>") -> dict:
    """Validate a table's JSON object field by field; return it unchanged or raise :class:`TableError`."""
    if not isinstance(t, dict):
        raise TableError(f"{where}: a table is a JSON object, got {type(t).__name__}")
    family = kind(t, where)
    for f in ("activation", "expression", "created"):
        need(t, f, str, where)
    if not t["activation"].isprintable() or not 0 < len(t["activation"]) <= 200:
        fail(where, "activation", "must be 1–200 printable characters")
    _check_expression(t, where)
    if need(t, "source", str, where) not in SOURCES:
        fail(where, "source", f"must be one of {SOURCES}")
    if t["source"] in ("paper", "derived"):
        need(t, "reference", str, where)
    prov = need(t, "provenance", dict, where)
    for f in ("method", "command", "package_version"):
        need(prov, f, str, f"{where} provenance")
    need(t, "metrics", dict, where)
    record = member(TABLE_FAMILIES, family, "schema checks")
    record.validate(t, where)
    if "certified" in t["metrics"]:
        record.check_certified(t, where)
    return t


def check_invact_certified(t: dict, where: str) -> None:
    """``metrics.certified`` of an InvAct table (written by ``approxbp certify``): each branch carries a rigorous bound
    ≥ the error attained and ≥ the sampled L∞."""
    c = need(t["metrics"], "certified", dict, f"{where} metrics")
    for side in branches_of(t):
        b = need(c, side, dict, f"{where} metrics.certified")
        for f in ("bound", "attained", "claim", "float32_evaluation"):
            if not (number(b.get(f)) and b[f] >= 0) and not (f == "float32_evaluation" and b.get(f) is None):
                fail(where, f"metrics.certified.{side}.{f}", "must be a finite number ≥ 0"
                      + (" (or null: no finite bound)" if f == "float32_evaluation" else ""))
        sampled = t["metrics"][f"linf_{side}"]
        if b.get("identity", False) is not False:  # proven exact (a derived table): the sample is rounding
            if b["identity"] is not True or b["bound"] != 0 or t["source"] != "derived":
                fail(where, f"metrics.certified.{side}.identity", "must be true, with bound 0, on a derived "
                      "table only")
            continue
        if b["bound"] < max(b["attained"], sampled * (1 - 1e-9)):
            fail(where, f"metrics.certified.{side}.bound", f"{b['bound']!r} is below the error attained "
                  f"({b['attained']!r}) or sampled ({sampled!r}): not a bound")


def recorded_loss_slack(objective: str, interval, knots, levels, loss: float) -> float:
    """How far a ReLU-sum table's recorded loss E = ∫_A^B (t − h̃)² may lie from the exact objective of its own
    numbers: 1e-12·E plus E's float64 rounding. However it was evaluated (eq. 14's closed form, the free levels'
    ∫h′² − Σ m·Δh, or quadrature split at the knots), E sums n + 1 pieces of ∫t² − 2∫t·h̃ + ∫h̃², so its
    absolute error is ≤ (n + 2)·u·2(∫t² + ∫h̃²), u = 2⁻⁵³; with t² ≤ 2h̃² + 2(t − h̃)², ∫t² + ∫h̃² ≤ 3∫h̃² + 2E,
    which the table's own knots and levels give (h̃′ = ℓ₀ + Σ w_i [x > c_i]; h̃ = ℓ₀x + Σ w_i ReLU(x − c_i)).
    At the float64 floor (hard-sigmoid's free levels: E ≈ 1e-16 from terms of size ∫h′² = 1/6) this term, not the
    relative one, is what a comparison must allow."""
    A, B = map(float, interval)
    c = np.asarray(knots, dtype=np.float64)
    lv = np.asarray(levels, dtype=np.float64)
    x = np.unique(np.clip(np.concatenate([[A, B], c]), A, B))
    lo, hi = x[:-1], x[1:]
    slope = lv[np.searchsorted(c, (lo + hi) / 2)]
    if objective == "derivative":
        h2 = float(np.sum((hi - lo) * slope**2))
    else:
        w = np.diff(lv)
        v = lv[0] * x + np.maximum(x[:, None] - c[None, :], 0.0) @ w  # h̃ at each break
        h2 = float(np.sum((hi - lo) * (v[:-1] ** 2 + v[:-1] * v[1:] + v[1:] ** 2) / 3))
    return 1e-12 * abs(loss) + (c.size + 2) * 2.0**-53 * 2 * (3 * h2 + 2 * abs(loss))


def check_relu_sum_certified(t: dict, where: str) -> None:
    """``metrics.certified`` of a ReLU-sum table: an objective enclosure that holds the recorded loss (within
    :func:`recorded_loss_slack`), and the global optimality gap where one was certified."""
    c = need(t["metrics"], "certified", dict, f"{where} metrics")
    lo_hi = c.get("objective")
    if not (isinstance(lo_hi, list) and len(lo_hi) == 2 and all(number(v) for v in lo_hi)):
        fail(where, "metrics.certified.objective", "must be [lower, upper] around the recorded loss")
    slack = recorded_loss_slack(t["objective"], t["interval"], t["knots"], t["levels"], t["loss"])
    if not lo_hi[0] - slack <= t["loss"] <= lo_hi[1] + slack:
        fail(where, "metrics.certified.objective", f"[{lo_hi[0]!r}, {lo_hi[1]!r}] does not hold the recorded loss "
             f"{t['loss']!r} within its float64 rounding ({slack:.3g})")
    if "global_gap" in c and not (number(c["global_gap"]) and c["global_gap"] >= 0):
        fail(where, "metrics.certified.global_gap", "must be a finite number ≥ 0")


def _check_expression(t: dict, where: str) -> None:
    """The expression parses (restricted grammar, never evaluated) and is the function the name says."""

    try:
        expr = get_activation(t["expression"]).expr
    except ValueError as err:
        fail(where, "expression", str(err))
    name = t["activation"]
    named = named_expression(name)
    if named is None and name != t["expression"]:
        try:
            named = get_activation(name).expression
        except ValueError:
            named = None  # a free-form label such as "my-mish": nothing to compare with
    if named is not None and get_activation(named).expr != expr:
        fail(where, "expression", f"{t['expression']!r} is not the activation {name!r} ({named})")


def validate_invact(t: dict, where: str) -> None:

    form = need(t, "form", str, where)
    if not SAFE_NAME.fullmatch(form):
        fail(where, "form", f"must match {SAFE_NAME.pattern}, got {form!r}")
    monotone = t.get("monotone", False)
    if not isinstance(monotone, bool):
        fail(where, "monotone", f"must be true or false, got {monotone!r}")
    for f in ("f_T",) if monotone else ("turning_point", "f_T"):
        v = need(t, f, (int, float), where)
        if not math.isfinite(v):
            fail(where, f, "must be finite")
    act = get_activation(t["expression"])
    if monotone:
        _check_monotone(t, act, where)
    else:
        T_, f_T = t["turning_point"], t["f_T"]
        slope, value = float(act.df(T_)), float(act.f(T_))
        if abs(slope) > 1e-9:
            fail(where, "turning_point", f"h′({T_!r}) = {slope:.3g}, not 0: not the minimiser of {t['expression']}")
        if abs(value - f_T) > 1e-12 * max(1.0, abs(f_T)):
            fail(where, "f_T", f"records {f_T!r} but h(T) = {value!r}")
    for side in branches_of(t):
        _check_branch(t, side, where)
    if "combined" in t:  # q(y, b), b = 1 on the left branch: one evaluation for both branches (the fast form)
        c = need(t, "combined", dict, where)
        need(c, "expression", str, f"{where} combined")
        if len(need(c, "coefficients", dict, f"{where} combined")) > MAX_COEFFICIENTS:
            fail(where, "combined.coefficients", f"a form has at most {MAX_COEFFICIENTS} coefficients")
        try:
            Form.from_table(Branch.from_json(c), ("y", "b"))
        except ValueError as err:
            fail(where, "combined.expression", str(err))
        _check_combined(t, where)
    for m in (f"{k}_{side}" for side in branches_of(t) for k in ("linf", "l2")):
        v = need(t["metrics"], m, (int, float), f"{where} metrics")
        if not (math.isfinite(v) and v >= 0):
            fail(where, f"metrics.{m}", f"must be finite and ≥ 0, got {v}")

def _check_branch(t: dict, side: str, where: str) -> None:
    """One branch of an InvAct table: its form parses (restricted grammar), its coefficients are finite numbers
    (at most MAX_COEFFICIENTS), its y-domain starts at f(T) and ascends."""
    f_T = t["f_T"]
    b = need(t, side, dict, where)
    need(b, "expression", str, f"{where} {side}")
    coeffs = need(b, "coefficients", dict, f"{where} {side}")
    if len(coeffs) > MAX_COEFFICIENTS:
        fail(where, f"{side}.coefficients", f"{len(coeffs)} coefficients; a form has at most {MAX_COEFFICIENTS}")
    for name, v in coeffs.items():
        if finite(v) is None:
            fail(where, f"{side}.coefficients.{name}", f"not a finite float ({number_text(v)})")
    lo, hi = floats(b, "domain", f"{where} {side}", 2)
    if not lo < hi:
        fail(where, f"{side}.domain", f"must be [f(T), end] ascending, got {[lo, hi]}")
    if abs(lo - f_T) > 1e-12 * max(1.0, abs(f_T)):
        fail(where, f"{side}.domain", f"must start at f(T) = {f_T!r}, got {lo!r}")
    assignments = b.get("assignments", [])
    if not isinstance(assignments, list) or not all(
            isinstance(a, list) and len(a) == 2 and all(isinstance(e, str) for e in a) for a in assignments):
        fail(where, f"{side}.assignments", "must be a list of [name, expression] pairs")
    try:
        Form.from_table(Branch.from_json(b))
    except ValueError as err:
        fail(where, f"{side}.expression", str(err))


#: Where a monotone table's activation is checked: increasing on [−MONOTONE_SPAN, MONOTONE_SPAN], and f_T its
#: infimum (f(−1e8) within 1e-6 of f_T: exponential or algebraic left tails both pass).
MONOTONE_SPAN = 60.0
#: f_T of a monotone table whose h → −∞ as x → −∞ (0.05·x left of 0, x + sin²x): −float32 max, so the kernels'
#: clamp max(y, f_T) leaves every finite float32 y alone; f increasing, a saved y still maps back to one x.
UNBOUNDED_BELOW = -3.4028234663852886e38


def not_increasing_at(act) -> float | None:
    """Where h′ is smallest on [−MONOTONE_SPAN, MONOTONE_SPAN] if it is not > 0 there (NaN counts), else None: the
    one test of "increasing" that the tables and the fits share. A smooth h whose h′ underflows to 0 in float64 on a
    left tail only (Gaussian tails: Φ(x) = 0 below x = −38) counts as increasing: an analytic h′ ≥ 0 vanishes on no
    interval unless h is constant."""
    grid = np.linspace(-MONOTONE_SPAN, MONOTONE_SPAN, 4001)
    with np.errstate(all="ignore"):
        slope = act.df(grid)
    if np.all(slope > 0):
        return None
    positive = slope > 0
    if np.all(slope >= 0) and positive[-1] and np.all(positive[np.argmax(positive):]) and not act.kinks():
        return None
    return float(grid[np.argmin(np.where(np.isfinite(slope), slope, -np.inf))])


def _flat_problem(t: dict, act) -> str | None:
    """Why a table whose h is not increasing everywhere cannot be monotone (None when it can): h′ < 0 (or NaN)
    somewhere, or its q is not 0 at the value of a constant piece (h′ = 0 there: ReLU6's 0 and 6, hard-sigmoid's 0
    and 1), which no increasing piece takes, so that a saved y still gives f′."""
    if not act.non_decreasing():
        bad = not_increasing_at(act)
        return f"h′({bad:.4g}) = {float(act.df(bad)):.3g}: {t['expression']} is not increasing"
    grid = np.linspace(-MONOTONE_SPAN, MONOTONE_SPAN, 4001)
    with np.errstate(all="ignore"):
        values = np.unique(act.f(grid[act.df(grid) == 0]))
        q = np.broadcast_to(np.asarray(Form.from_table(Branch.from_json(t["right"]))(values), dtype=np.float64),
                            values.shape)
    if np.any(q != 0):
        i = int(np.argmax(q != 0))
        return (f"h is constant at {values[i]:.6g} (h′ = 0), but the right form gives q = {q[i]!r} there: a "
                "non-decreasing table needs q = 0 at its constant pieces' values")
    return None


def _check_monotone(t: dict, act, where: str) -> None:
    """A monotone table (one branch, y = f(x) ↦ f′(f⁻¹(y)) with no branch bit): f increases (or does not decrease,
    with q = 0 at its constant pieces' values), f_T = inf f, and no turning point, left branch or combined form is
    given."""
    for f in ("turning_point", "left", "combined"):
        if f in t:
            fail(where, f, "a monotone table has one branch: no turning point, left branch or combined form")
    if not_increasing_at(act) is not None and (why := _flat_problem(t, act)):
        fail(where, "monotone", why)
    with np.errstate(all="ignore"):
        low = float(act.f(-1e8))
    if t["f_T"] == UNBOUNDED_BELOW:  # h → −∞: h(−1e8) far below h(0) and still falling at −1e16
        with np.errstate(all="ignore"):
            lower, zero = float(act.f(-1e16)), float(act.f(0.0))
        if not (math.isfinite(low) and low < zero - 1e6 and (lower < low or lower == -math.inf)):
            fail(where, "f_T", f"records {UNBOUNDED_BELOW!r} (h unbounded below) but h(−1e8) = {low!r}, "
                               f"h(−1e16) = {lower!r}")
        return
    if not (math.isfinite(low) and abs(low - t["f_T"]) <= 1e-6 * max(1.0, abs(t["f_T"]))):
        fail(where, "f_T", f"records {t['f_T']!r} but h(−1e8) = {low!r}: f_T must be lim_(x→−∞) h")


def _check_combined(t: dict, where: str) -> None:
    """The combined q(y, b) is what the backward evaluates: on each branch's domain it must be finite and equal the
    branch form (b = 1 left, 0 right) to 1e-9, as every fitted table's does exactly. Checked once per distinct
    (combined, left, right) in a process: a table is loaded at every drop-in's construction."""
    problem = _combined_problem(json.dumps([t["combined"], t["left"], t["right"]], sort_keys=True))
    if problem:
        fail(where, "combined", problem)


@functools.lru_cache(maxsize=256)
def _combined_problem(forms: str) -> str | None:


    combined_json, *branches = json.loads(forms)
    combined = Form.from_table(Branch.from_json(combined_json), ("y", "b"))
    run = combined.compile(numpy_namespace(), [sp.Symbol("b"), *map(sp.Symbol, combined.coefficients)])
    for side, b, branch in zip(("left", "right"), (1.0, 0.0), branches):
        lo, hi = branch["domain"]
        ys = np.linspace(lo, hi, 257)[1:-1]
        with np.errstate(all="ignore"):
            got = np.broadcast_to(np.asarray(run(ys, np.full_like(ys, b), *combined.coefficients.values()),
                                             dtype=np.float64), ys.shape)
        want = Form.from_table(Branch.from_json(branch))(ys)
        err = np.abs(got - want)
        if not np.all(np.isfinite(got)) or not np.all(err <= 1e-9 * (1 + np.abs(want))):
            bad = int(np.argmax(np.where(np.isfinite(got), err, np.inf)))
            return (f"must equal the {side} form on its domain (b = {b:g}); at y = {ys[bad]:.6g} it gives "
                    f"{float(got[bad])!r}, the {side} form {float(want[bad])!r}")
    return None


def validate_relu_sum(t: dict, where: str) -> None:
    bits = need(t, "bits", int, where)
    if not 1 <= bits <= MAX_BITS:
        fail(where, "bits", f"must be in 1..{MAX_BITS}, got {bits}")
    n = 2**bits - 1
    if need(t, "objective", str, where) not in OBJECTIVES:
        fail(where, "objective", f"must be one of {OBJECTIVES}")
    a, b = floats(t, "interval", where, 2)
    if not a < b:
        fail(where, "interval", f"must be [A, B] with A < B, got {[a, b]}")
    w = floats(t, "weights", where, n)
    c = floats(t, "knots", where, n)
    levels = floats(t, "levels", where, n + 1)
    if np.any(np.diff(c) <= 0):
        fail(where, "knots", "must be strictly ascending (no repeated knots)")
    if c[0] < a or c[-1] > b:
        fail(where, "knots", f"must lie inside the interval [{a!r}, {b!r}]")
    rule = t.get("levels_rule", "eq13")
    if rule not in LEVELS_RULES:
        fail(where, "levels_rule", f"must be one of {LEVELS_RULES}, got {rule!r:.40}")
    if rule == "free" and t["objective"] != "derivative":
        fail(where, "objective", "a free-level table fits the derivative (FewBit's objective)")
    base = levels[0] if rule == "free" else 0.0  # free: h̃′ = ℓ₀ + Σ w_i [x > c_i]; eq. 13: ℓ₀ = 0
    scale = max(1.0, np.abs(levels).max()) if rule == "free" else 1.0  # free levels need not be O(1)
    if np.max(np.abs(levels - base - np.concatenate([[0.0], np.cumsum(w)]))) > 1e-14 * scale:
        fail(where, "levels", "do not equal the cumulative sums [ℓ₀, ℓ₀ + w1, ℓ₀ + w1 + w2, …] of the weights"
             + (" (ℓ₀ = 0: eq. 13)" if rule == "eq13" else ""))
    loss = need(t, "loss", (int, float), where)
    if not (math.isfinite(loss) and loss >= 0):
        fail(where, "loss", f"must be finite and ≥ 0, got {loss}")
    res = need(t, "constraint_residual", (int, float), where)
    actual = max(abs(w.sum() - 1.0), abs(float(np.dot(w, c))))
    if abs(res - actual) > 1e-15 + 1e-9 * actual:
        fail(where, "constraint_residual", f"records {res!r} but the weights and knots give {actual!r}")
    tol = CONSTRAINT_TOL if t["source"] == "fit" else PAPER_CONSTRAINT_TOL
    if actual > tol and rule == "eq13":
        fail(where, "constraint_residual", f"{actual:.3g} > {tol:g}: Σw=1, Σw·c=0 must hold")
