"""Certified numerics: rigorous bounds by interval (ball) arithmetic, not samples (python-flint's Arb).

InvAct (Inverted Activations §2, eq. 3). The kernel computes dx = dy·q_s(y) from the saved output y = f(x) and
the branch bit s = [x < T]; exact is g(y) = f′(f⁻¹_s(y)). Parametrised by x, no inverse is needed:

    err(x) = q_s(f(x)) − f′(x),   x ∈ [−2^64, T] (left, s = 1) and [T, 2^64] (right, s = 0),

which covers every output y ≤ f(2^64) ≈ 1.8e19 of each branch, the table's forms, its clamps and its tail rule
included (:func:`~approxbp.approximations.invact_forms.backward_rule`, the rule the kernels print), with the
table's numbers as stored (``rounded=True``: each rounded to float32, as the kernels write them; near T that
moves f(T) by up to half an ulp, and the error there grows to √(2f″(T)·ulp) ≈ 7e-5 for GELU). Adaptive
subdivision of x (bisection, geometric for wide boxes) bounds |err| on each box by the mean-value form
err(m) + err′(X)·(X − m) ∩ the direct enclosure, until the largest box bound is within ``rtol`` of the largest
error found at a box midpoint (a rigorous lower bound), or the time budget ends.

The float32 evaluation error of the kernel's formula is bounded per y-box by a running error analysis of the same
expression (:mod:`.intervals`: IEEE +, −, ×, documented ulps of ÷, sqrt, exp, …, lg2.approx's error,
:func:`log_error`). A table fitted with a weight is not certified (said): the enclosures are of the uniform objective.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import sympy as sp
from approxbp.approximations import balls, get_activation
from approxbp.approximations.activations import x as X_SYMBOL
from approxbp.approximations.elementary import LG2_ABS_ERROR, LN2
from approxbp.approximations.families import Registry, member, register
from approxbp.approximations.invact_forms import Form, backward_rule
from approxbp.approximations.invact_forms import y as FORM_Y
from approxbp.approximations.rewrites import stable_form
from approxbp.approximations.table_checks import recorded_loss_slack
from approxbp.approximations.tables import InvActTable, as_table, load, save
from flint import arb

from . import intervals as iv
from .identity import identity_proof
from .intervals import Ball, Evaluator, box, float32, lower, number, upper
from .optimality import certify_relu_sum_global, relu_sum_objective
from .progress import heartbeat
from .result import Verdict

__all__ = ["certifiable", "Certificate", "CERTIFIERS", "certify_files", "certify_invact_branch", "certify_table",
           "CertifyFamily", "float32_error", "InvactRule", "log_error", "NewtonSteps", "supremum"]


#: |x| up to which InvAct certificates reach (y up to f(2^64) ≈ 1.8e19; beyond, Arb cannot enclose e^{x³}).
_X_LIMIT = 2.0**64
#: At most this many boxes per InvAct branch (a count, not a time, so a stored certificate is the same on any
#: machine; the packaged fast forms need 55 000–200 000).
_MAX_BOXES = 300_000
#: Stop refining once the certified bound is within this factor of the error actually attained.
_RTOL = 0.02


@dataclass
class Certificate:
    """A rigorous bound ``bound`` ≥ sup |error| over ``domain``; ``attained`` ≤ that sup is the largest error at
    a point (a rigorous lower bound), found at ``where``. ``claim`` is what the table states; ``passed`` iff
    bound ≤ claim."""

    what: str
    domain: tuple[float, float]
    bound: float
    attained: float
    where: float
    claim: float
    passed: bool
    boxes: int
    seconds: float
    converged: bool

    def to_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "what"}


# ---- adaptive subdivision ------------------------------------------------------------------------------------
def _split(lo: float | arb, hi: float | arb) -> arb:
    """Where to split [lo, hi]: geometric mean for a wide box of one sign, else the midpoint (exact)."""
    lo, hi = arb(lo), arb(hi)
    if lo > 0 and hi > 4 * lo:
        return (lo * hi).sqrt().mid()
    if hi < 0 and lo < 4 * hi:
        return -(lo * hi).sqrt().mid()
    return ((lo + hi) / 2).mid()


def supremum(bound_on, pieces, rtol: float = _RTOL, budget_s: float = 120.0, claim: float = math.inf,
             what: str = "", max_boxes: int | None = None, say=None) -> Certificate:
    """A certified sup |err| over the union of ``pieces`` [(lo, hi), …]. ``bound_on(lo, hi)`` returns
    (upper bound of |err| on [lo, hi], lower bound of |err(m)| at a point m, m as a float).

    Refines the box with the largest bound first; stops when that bound is ≤ (1 + rtol)·(largest attained), or
    when ``budget_s`` is spent or ``max_boxes`` evaluated (``converged`` False; the bound stands, only looser)."""
    start = time.perf_counter()
    heap, best, where, count = [], 0.0, math.nan, 0

    def push(lo, hi):
        nonlocal best, where, count
        up, low, m = bound_on(lo, hi)
        count += 1
        up = up if up >= 0 else math.inf  # a NaN upper bound proves nothing: the box is refined first, never lost
        if low > best:
            best, where = low, m
        heapq.heappush(heap, (-up, count, lo, hi))

    for lo, hi in pieces:
        push(arb(lo), arb(hi))
    converged = True
    tick = heartbeat(say, what)
    while heap:
        up = -heap[0][0]
        tick(lambda up=up: f"{count} boxes, bound {up:.4e}, attained {best:.4e}")
        if up <= best * (1 + rtol) or up == 0.0:
            break
        if time.perf_counter() - start > budget_s or (max_boxes is not None and count >= max_boxes):
            converged = False
            break
        _, _, lo, hi = heapq.heappop(heap)
        mid = _split(lo, hi)
        if not (lo < mid < hi):  # cannot split further
            heapq.heappush(heap, (-up, 0, lo, hi))
            converged = False
            break
        push(lo, mid)
        push(mid, hi)
    bound = -heap[0][0] if heap else 0.0
    if best == 0.0 and heap:  # nothing attained to report (a rounding bound): where the bound is reached
        where = float(_split(heap[0][2], heap[0][3]))
    lo_all, hi_all = float(arb(pieces[0][0]).mid()), float(arb(pieces[-1][1]).mid())
    return Certificate(what, (lo_all, hi_all), bound, best, where, claim, bound <= claim, count,
                       round(time.perf_counter() - start, 2), converged)


# ---- InvAct ------------------------------------------------------------------------------------------------
def _claim_of(t: InvActTable, branch: str) -> float:
    """What a table claims for a branch: the fitter's tolerance (fast forms), else twice the sampled L∞ (a sampled
    maximum is trusted to a factor 2; the certificate exists to catch what sampling misses by orders of
    magnitude, as the newton forms' left tails did)."""
    tol = (t.metrics.get("fast") or {}).get("tolerance")
    return float(tol) if tol is not None else 2 * float(t.metrics[f"linf_{branch}"])


class InvactRule:
    """The backward multiplier the kernels compute for one table and branch, on balls: backward_rule with the
    table's forms, float32 constants (``rounded``), and the activation's derivative for the tail rule."""

    def __init__(self, t: InvActTable, branch: str, rounded: bool = True, fp32: bool = False,
                 log_error: tuple[float, float] = (0.0, 0.0)):
        act = get_activation(t.expression)
        const = float32 if rounded else number
        forms = {f"q_{b}": (Form.from_table(getattr(t, b)), ()) for b in t.branches}
        if t.combined is not None:
            forms["q_combined"] = (Form.from_table(t.combined, ("y", "b")), (sp.Symbol("b"),))
        calls = {name: self._form_call(form, extra) for name, (form, extra) in forms.items()}
        calls["activation_grad"] = lambda a: self.kernel(self.df, {X_SYMBOL: a})
        self.kernel = Evaluator(calls, const, fp32=fp32, log_error=log_error)
        self.truth = Evaluator()
        self.rule, self.y = backward_rule(t), sp.Symbol("y")
        self.flag = {sp.Symbol("b"): self._constant(1 if branch == "left" else 0)}
        # the evaluators' rewrites (softplus, σ): e^x/(1 + e^x) on [21142, 21170] is a ball of width e^28
        self.f, self.df = stable_form(act.expr), stable_form(act.derivative_expr(1))
        #: the branch's damped Newton steps when its form has exactly that structure; their error is propagated
        #: (``newton``) only for the stored numbers: rounded constants change f inside the steps
        self.steps = NewtonSteps.of(t, branch, act) if t.combined is None else None
        self.newton = None if rounded else self.steps

    def _constant(self, v) -> Ball:
        return Ball(self.kernel.constant(v), arb(0), arb(0) if self.kernel.fp32 else None)

    def _form_call(self, form: Form, extra):
        coefficients = None  # balls of the form's numbers, made on the first call (the kernel evaluator exists then)

        def call(*args: Ball) -> Ball:
            nonlocal coefficients
            if coefficients is None:
                coefficients = {sp.Symbol(k): self._constant(v) for k, v in form.coefficients.items()}
            env = {FORM_Y: args[0], **dict(zip(extra, args[1:])), **coefficients}
            for name, value in form.assignments:
                env[sp.Symbol(name)] = self.kernel(value, env)
            return self.kernel(form.expression, env)

        return call

    def q(self, yb: Ball) -> Ball:
        return self.kernel(self.rule, {self.y: yb, **self.flag})

    def _activation(self, xb: Ball) -> tuple[Ball, Ball]:
        return self.truth(self.f, {X_SYMBOL: xb}), self.truth(self.df, {X_SYMBOL: xb})

    def bound_on(self, lo: arb, hi: arb):
        """(upper bound of |err| on [lo, hi], |err| at the split point (a lower bound of the sup), that point).
        f(X) and f′(X) enter centred, f(m) + f′(X)·(X − m): near T that keeps y − f(T) ≥ 0 tight (∝ (x − T)²),
        where the plain enclosure would wrap to ±|X − T|."""
        xs = box(lo, hi)
        mid = _split(lo, hi)
        f_m, df_m = self._activation(Ball(mid, None))
        f_x, df_x = self._activation(Ball(xs, arb(1)))
        y = Ball(iv.enclosure(f_m, f_x, xs, mid), f_x.d)
        slope = Ball(iv.enclosure(df_m, df_x, xs, mid), df_x.d)
        over, at = self.q(y), self.q(f_m)
        err = Ball(over.v - slope.v, None if over.d is None or slope.d is None else over.d - slope.d)
        err_m = Ball(at.v - df_m.v)
        bound = upper(iv.enclosure(err_m, err, xs, mid))
        if self.newton is not None:
            bound = min(bound, self.newton.bound(self, xs, mid, y, f_m))
        return bound, lower(err_m.v), float(mid)


class NewtonSteps:
    """The ``newton`` forms (invact_forms.newton_form): x₀(y), then x_{k+1} = x_k − (f(x_k) − y)·d_k/(d_k² + ε²)
    with d_k = f′(x_k), and q = f′(x_n). Enclosing the steps directly wraps (the step's y-derivative is ~1/ε
    near T), so their error is propagated instead. With e_k = x_k − x, Taylor at x_k gives
    f(x_k) − y = d_k·e_k − f″(ζ)·e_k²/2, ζ between x and x_k, hence exactly

        e_{k+1} = e_k·ε²/(d_k² + ε²) + f″(ζ)·e_k²·d_k/(2(d_k² + ε²)),    q − f′(x) = f″(ζ′)·e_n,

    enclosed from e₀ = x₀(f(x)) − x (the mean-value form on the x-box), d_k ∈ f′(X + E_k) and
    ζ ∈ X + hull(0, E_k). Used where the y-box lies inside the form's domain (no clamp or tail rule acts)."""

    def __init__(self, form: Form, steps: int, eps2: arb, domain: tuple[float, float], act):
        self.form, self.steps, self.eps2 = form, steps, arb(eps2)
        self.y_lo, self.y_hi = arb(domain[0]), arb(domain[1])
        self.d2f = stable_form(act.derivative_expr(2))
        self.x0 = dict(form.assignments)["x0"]
        self._coefficients = None  # balls of x₀'s numbers, made on the first box (by the rule's evaluator)

    @classmethod
    def of(cls, t: InvActTable, branch: str, act) -> NewtonSteps | None:
        """The steps of a branch when its form is exactly newton_form's structure (checked, not assumed)."""
        form = Form.from_table(getattr(t, branch))
        names = [n for n, _ in form.assignments]
        steps = (len(names) - 1) // 2
        if steps < 1 or names != ["x0", *[n for k in range(steps) for n in (f"d{k}", f"x{k + 1}")]]:
            return None
        f, df, given, eps2 = act.expr, act.derivative_expr(1), dict(form.assignments), set()
        for k in range(steps):
            xk, dk = sp.Symbol(f"x{k}"), sp.Symbol(f"d{k}")
            w = sp.Wild("w", exclude=[xk, dk, FORM_Y], properties=[lambda v: v.is_Number and v > 0])
            match = given[f"x{k + 1}"].match(xk - (f.subs(X_SYMBOL, xk) - FORM_Y) * dk / (dk**2 + w))
            if match is None or sp.simplify(given[f"d{k}"] - df.subs(X_SYMBOL, xk)) != 0:
                return None
            eps2.add(match[w])
        if len(eps2) != 1 or sp.simplify(form.expression - df.subs(X_SYMBOL, sp.Symbol(f"x{steps}"))) != 0:
            return None
        return cls(form, steps, iv.number(eps2.pop()), tuple(getattr(t, branch).domain), act)

    def bound(self, rule: InvactRule, xs: arb, mid: arb, y: Ball, f_m: Ball) -> float:
        """An upper bound of |q(f(x)) − f′(x)| on the x-box ``xs`` (inf where the y-box leaves the domain)."""
        if not (y.v.lower() >= self.y_lo and y.v.upper() <= self.y_hi):
            return math.inf
        if self._coefficients is None:
            self._coefficients = {sp.Symbol(k): rule._constant(v) for k, v in self.form.coefficients.items()}
        env = self._coefficients
        x0, x0_m = rule.kernel(self.x0, {FORM_Y: y, **env}), rule.kernel(self.x0, {FORM_Y: f_m, **env})
        e0 = Ball(x0.v - xs, None if x0.d is None else x0.d - 1)
        e = iv.enclosure(Ball(x0_m.v - mid), e0, xs, mid)

        def curvature(e):  # f″ between x and x + e
            return rule.truth(self.d2f, {X_SYMBOL: Ball(xs + e.union(arb(0)))}).v

        for _ in range(self.steps):
            d = rule.truth(rule.df, {X_SYMBOL: Ball(xs + e)}).v
            denom = balls.square(d) + self.eps2
            e = e * self.eps2 / denom + curvature(e) * balls.square(e) * d / (2 * denom)
        return upper(curvature(e) * e)


def _x_pieces(t: InvActTable, branch: str) -> list[tuple[float, float]]:
    """The branch's x-range [−2^64, T] or [T, 2^64] (a monotone table's one branch: [−2^64, 2^64]), pre-split at
    ±1 and ±16 (geometric splits take over)."""
    T = -_X_LIMIT if t.monotone else t.turning_point
    cuts = [c for c in (-16.0, -1.0, 0.0, 1.0, 16.0) if (c < T if branch == "left" else c > T)]
    ends = [-_X_LIMIT, *cuts, T] if branch == "left" else [T, *cuts, _X_LIMIT]
    return list(zip(ends[:-1], ends[1:]))


@iv.at_precision
def certify_invact_branch(t, branch: str, budget_s: float = 600.0, rtol: float = _RTOL,
                          rounded: bool = False, max_boxes: int = _MAX_BOXES, rule: InvactRule | None = None,
                          say=None) -> Certificate:
    """Certified sup over x of |q_s(f(x)) − f′(x)| for one branch of an InvAct table, in real arithmetic with
    the table's numbers (``rounded``: each number rounded to float32, as the kernels write it; ``rule``: the
    branch's InvactRule when the caller has built it)."""
    t = as_table(t)
    rule = rule or InvactRule(t, branch, rounded=rounded)
    return supremum(rule.bound_on, _x_pieces(t, branch), rtol, budget_s, _claim_of(t, branch),
                    f"{t.name} {branch}: |q(f(x)) − f′(x)|", max_boxes=max_boxes, say=say)


@iv.at_precision
def float32_error(t, branch: str, budget_s: float = 60.0, max_boxes: int = 3000) -> Certificate:
    """A bound on |fl32(q_s(y)) − q_s(y)| over the branch's float32 outputs y: what rounding in the kernel adds
    to the real-number error. Each y-box gets a running error bound of the rule's expression (intervals.py); the
    worst boxes are bisected until ``max_boxes`` (no attained value exists to stop against)."""
    t = as_table(t)
    rule = InvactRule(t, branch, fp32=True, log_error=log_error())
    top = float(np.finfo(np.float32).max)
    lo, hi = (t.f_T, -1e-45) if branch == "left" else (t.f_T, top)
    zero = arb(0)

    def bound_on(a, b):
        yb = rule.q(Ball(box(a, b), None, zero))
        return upper(yb.e), 0.0, float(_split(a, b))

    cuts = [c for c in (-0.01, -1e-4, -1e-8, 1.0, 16.0, 256.0) if lo < c < hi]
    ends = [lo, *cuts, hi]
    return supremum(bound_on, list(zip(ends[:-1], ends[1:])), budget_s=budget_s, max_boxes=max_boxes,
                    what=f"{t.name} {branch}: float32 evaluation")


# ---- the kernels' log ------------------------------------------------------------------------------------------
@iv.at_precision
def log_error() -> tuple[float, float]:
    """(A, B) with |_log(v) − log v| ≤ A + B·|log v| for positive float32 v: the kernels' log is fl(L·c), L =
    lg2.approx(v) = log2 v + δ with |δ| ≤ Δ (elementary.LG2_ABS_ERROR), c = float32(ln 2). Then
    |fl(L·c) − log v| ≤ |log2 v|·|c − ln 2| + Δ·c + (|log2 v| + Δ)·c·u, so A = Δ·c·(1 + u) and
    B = (|c − ln 2| + c·u)/ln 2."""
    c, ln2, u = float32(LN2), arb(2).log(), arb(iv.U32)
    return upper(arb(LG2_ABS_ERROR) * c * (1 + u)), upper((abs(c - ln2) + c * u) / ln2)


# ---- one entry point per table ---------------------------------------------------------------------------
#: Significant digits kept in a table's certified metrics (the bound is rounded up, the attained value down).
_DIGITS = 4


def _round(v: float, up: bool) -> float:
    if not math.isfinite(v) or v == 0:
        return v
    scale = 10.0 ** (math.floor(math.log10(abs(v))) - _DIGITS + 1)
    return float(f"{(math.ceil if up else math.floor)(v / scale) * scale:.{_DIGITS}g}")


@iv.at_precision
def certify_table(t, budget_s: float = 600.0, rtol: float = _RTOL, progress=None,
                  rounded: bool = False, max_boxes: int | None = None, emit=None
                  ) -> tuple[dict | None, list[str], Verdict]:
    """Certify one table: (the ``metrics["certified"]`` entry or None when a bound is not finite, printable lines,
    the :class:`Verdict`, truthy when every claim holds).

    InvAct: per branch the certified sup of |q_s(f(x)) − f′(x)| (claim: :func:`_claim_of`) and the float32
    evaluation bound; ``rounded``: the form's numbers rounded to float32 first. ReLU-sum: an enclosure of the
    objective (it must contain the recorded loss within its float64 rounding, :func:`recorded_loss_slack`), and
    for k ≤ 2 the global optimality gap (target 1e-9). Each certificate stops at ``budget_s`` seconds or
    ``max_boxes`` boxes (InvAct default :data:`_MAX_BOXES`), whichever comes first. ``emit``: called with each
    line as soon as its certificate is done (a branch, a bound), so that a long run says something per branch even
    without progress."""
    t = as_table(t)
    if "weight" in (t.metrics or {}):  # its loss is ∫(·)²p: the certifiers enclose the uniform objective
        _Lines(emit).append(line := f"{t.name:<28} not certified: fitted with --weight {t.metrics['weight']}")
        return None, [line], Verdict.UNCERTIFIABLE
    certify = member(CERTIFIERS, t.family, "certificate").certify
    return certify(t, budget_s, rtol, progress, rounded, max_boxes, _Lines(emit))


class _Lines(list):
    """The printable lines of a certificate, each also handed to ``emit`` when it is added."""

    def __init__(self, emit=None):
        super().__init__()
        self.emit = emit

    def append(self, line: str) -> None:
        super().append(line)
        if self.emit is not None:
            self.emit(line)


def _certify_invact_table(t, budget_s, rtol, progress, rounded, max_boxes, lines=None
                          ) -> tuple[dict | None, list[str], Verdict]:
    """:func:`certify_table` for an InvAct table: each branch proven exact (sympy identity) or bounded in balls."""
    lines = _Lines() if lines is None else lines
    say = progress or (lambda msg: None)
    ok, entry, newton = Verdict.HELD, {}, False
    for branch in t.branches:
        say(f"{t.name} {branch}")
        if identity_proof(t, branch):  # exact: the real-number error is 0, only float32 evaluation remains
            f32 = float32_error(t, branch, budget_s=min(60.0, budget_s)).bound
            entry[branch] = {"bound": 0.0, "attained": 0.0, "at_x": 0.0, "claim": _claim_of(t, branch),
                             "identity": True,
                             "float32_evaluation": _round(f32, True) if math.isfinite(f32) else None}
            lines.append(f"{t.name:<22} {branch:<5} exact: sympy proves q(f(x)) − f′(x) ≡ 0; float32 evaluation "
                         + (f"≤ {f32:.2e}" if math.isfinite(f32) else "not bounded"))
            continue
        rule = InvactRule(t, branch, rounded=rounded)  # the ball rule only where no identity proves the branch
        cert = certify_invact_branch(t, branch, budget_s, rtol, rounded=rounded, rule=rule,
                                     max_boxes=_MAX_BOXES if max_boxes is None else max_boxes, say=progress)
        # a running error analysis treats each rounding as independent: it cannot see Newton's self-correction
        # and bounds the newton forms' float32 evaluation by 1e-3…inf (measured in float32: ≤ 3.5e-5)
        newton = rule.steps is not None
        f32 = math.inf if newton else float32_error(t, branch, budget_s=min(60.0, budget_s)).bound
        entry[branch] = {"bound": _round(cert.bound, True), "attained": _round(cert.attained, False),
                         "at_x": float(f"{cert.where:.6g}"), "claim": cert.claim,
                         "float32_evaluation": _round(f32, True) if math.isfinite(f32) else None}
        ok &= Verdict.of(cert.passed, violated=cert.attained > cert.claim)
        verdict = "ok" if cert.passed else ("VIOLATED" if cert.attained > cert.claim else "not certified (budget)")
        lines.append(f"{t.name:<22} {branch:<5} certified {cert.bound:.4e} (attained {cert.attained:.4e} at "
                     f"x = {cert.where:.6g}; sampled {t.metrics[f'linf_{branch}']:.4e}) claim {cert.claim:.2e} "
                     f"{verdict}; float32 evaluation "
                     f"{'not bounded (Newton steps)' if newton else f'≤ {f32:.2e}'}; "
                     f"{cert.boxes} boxes, {cert.seconds:.1f} s"
                     + ("" if cert.converged or not cert.passed else " (budget reached before the bound came "
                        f"within {rtol:g} of the attained error: the bound holds, looser)"))
    entry["method"] = _invact_method(t, entry, newton)
    if not all(math.isfinite(entry[b]["bound"]) for b in t.branches):
        lines.append(f"{t.name:<22} no finite bound within the budget: nothing to store")
        return None, lines, ok & Verdict.OPEN
    return entry, lines, ok


def _invact_method(t, entry: dict, newton: bool) -> str:
    """How an InvAct table's certificate was obtained, as stored in ``metrics.certified.method``."""
    if all(entry[b].get("identity") for b in t.branches):
        return "sympy: q(f(x)) − f′(x) ≡ 0 on every branch; float32 evaluation: running error bound"
    pieces = "[-2^64, 2^64] (one branch)" if t.monotone else "[-2^64, T] and [T, 2^64]"
    return (f"Arb ball arithmetic (python-flint): adaptive subdivision of x over {pieces} with the mean-value form"
            + ("; Newton steps by error propagation" if newton else "; float32 evaluation: running error bound"))


def _certify_relu_sum_table(t, budget_s: float, rtol: float, progress, rounded: bool, max_boxes,
                            lines: _Lines) -> tuple[dict | None, list[str], Verdict]:
    """:func:`certify_table` for a ReLU-sum table: the objective's enclosure, and global optimality for k ≤ 2
    (``rtol``, ``rounded``: InvAct's, unused)."""
    (progress or (lambda msg: None))(t.name)
    enclosure = relu_sum_objective(t)
    # the recorded loss is a float64 value: it may lie off the exact objective by its own rounding, which at the
    # float64 floor (free levels of hard-sigmoid, E ≈ 1e-16) is absolute, not relative
    slack = recorded_loss_slack(t.objective, t.interval, t.knots, t.levels, t.loss)
    if not enclosure.is_finite():  # Arb could not enclose the integral: nothing is proven, nothing violated
        lines.append(f"{t.name:<28} objective: no finite enclosure ({enclosure}); not certified")
        return None, lines, Verdict.OPEN
    consistent = bool(abs(enclosure - t.loss).upper() <= slack)
    ok = Verdict.HELD if consistent else Verdict.FAILED
    entry = {"objective": [float(enclosure.lower()), float(enclosure.upper())]}
    lines.append(f"{t.name:<28} objective ∈ [{float(enclosure.lower()):.16e}, {float(enclosure.upper()):.16e}]; "
                 f"recorded loss {t.loss:.16e} "
                 + (f"inside (within its float64 rounding, {slack:.2g})" if consistent else "OUTSIDE: FAILED"))
    if t.levels_rule == "free":
        lines.append(f"{'':<28} global optimum: not attempted (free levels: the branch and bound is eq. 13's); "
                     "only the objective above is certified")
    elif t.bits <= 2 and get_activation(t.expression).kinks():
        lines.append(f"{'':<28} global optimum: not attempted (a piecewise h: the branch and bound integrates h "
                     "whole, not piece by piece); only the objective above is certified")
    elif t.bits <= 2:
        g = certify_relu_sum_global(t, budget_s=budget_s, max_boxes=max_boxes, say=progress)
        entry["global_gap"] = _round(g.gap, True)
        ok &= Verdict.of(g.passed, violated="a better point exists" in g.note)
        verdict = ("ok" if g.passed else "VIOLATED (a better point exists)" if "a better point exists" in g.note
                   else "not certified (budget: the gap did not close; more --budget or boxes)")
        lines.append(f"{'':<28} global optimum: gap {g.gap:.2e} (target {g.target_gap:.0e}) {verdict}; "
                     f"{g.boxes} boxes, {g.seconds:.1f} s; {g.note}")
    else:
        lines.append(f"{'':<28} global optimum: not attempted (the branch and bound covers k ≤ 2); only the "
                     "objective above is certified")
    return entry, lines, ok


def certify_files(paths, *, write: bool = False, only_default: bool = False, progress=None, **options):
    """Certify each table file (:func:`certify_table` with ``options``); ``write``: its certificate stored in its
    metrics (``approxbp certify --write``); ``only_default``: only :func:`certifiable` ones. Yields (table name,
    printable lines, :class:`Verdict`) as each table is done."""
    for path in paths:
        t = load(path)
        if only_default and not certifiable(t):
            continue
        entry, lines, held = certify_table(t, progress=progress, **options)
        if write and entry is not None:
            save(t.with_metrics(certified=entry), path)
        yield t.name, lines, held


def certifiable(t) -> bool:
    """The packaged tables ``approxbp certify`` runs on by default: the InvAct ``fast`` forms, the monotone exact
    and ``newton`` ones (:class:`NewtonSteps`), and the fitted ReLU-sum tables of gelu and silu with k ≤ 2."""
    t = as_table(t)
    return member(CERTIFIERS, t.family, "certificate").by_default(t)


@dataclass(frozen=True)
class CertifyFamily:
    """This layer's part of a table family (:mod:`approxbp.approximations.families`): ``certify(t, budget_s, rtol,
    progress, rounded, max_boxes, lines)`` → (entry, lines, held), and ``by_default``: what `certify` runs on."""

    certify: Callable
    by_default: Callable[[object], bool]


#: family name → its certificate (the built-in families: below)
CERTIFIERS: Registry = Registry("approxbp.certify")
register(CERTIFIERS, "invact", CertifyFamily(_certify_invact_table,
                                             lambda t: t.form in ("fast", "newton") or t.monotone))
register(CERTIFIERS, "relu-sum", CertifyFamily(
    _certify_relu_sum_table, lambda t: t.bits <= 2 and t.source == "fit" and t.activation in ("gelu", "silu")))
