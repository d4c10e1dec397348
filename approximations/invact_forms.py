"""Approximations q(y) ≈ g(y) = f'(f⁻¹(y)) for inverted activations, and how they are measured.

A form is a sympy expression in ``y`` with named coefficients (symbols c0, c1, … or the released
names), so tables can store the structure and the numbers separately and refits reuse the structure.

Error metrics per branch, over the branch's y-domain D (left: [f(T), lim_{−∞} f]; right:
[f(T), f(T) + 10]): L∞ = max |g − q| on a grid dense at the turning point (20001 points uniform in
s = √(y − f(T))) and, on the left, at y = f(x) for 4001 x log-spaced from T to T − 1000 (the uniform-s grid puts
no point between y = −1.7e-5 and 0, i.e. x < −4.5 for GELU, where ``approxbp certify`` found errors 1000× the
grid's), L2 = (∫_D (g − q)² dy / |D|)^{1/2} (RMS over y).
"""

from __future__ import annotations

import keyword
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import sympy as sp

from .activations import get_activation
from .backends import grammar, numpy_namespace, torch_namespace
from .expressions import parse as parse_expression
from .functions import select
from .invact import InvertedActivation, check_branch
from .rewrites import stable_form

__all__ = ["backward_rule", "branch_grid", "branch_metrics", "Form", "GRID", "newton_form", "published_forms",
           "RIGHT_SPAN", "right_tail_error", "RULE_PARTS", "TableBackward", "with_newton_steps", "y"]


y = sp.Symbol("y", real=True)
RIGHT_SPAN = 10.0
_NEWTON_EPS = 1e-5
GRID = 20001


#: Names a form's coefficients and assignments may not take: the generated q functions see these (the Triton
#: modules, the variables, the module's own functions); Python keywords and names starting with _ are refused too.
#: The parts :func:`backward_rule` calls: each generated module defines them (Triton) and their twins (``<part>_twin``).
RULE_PARTS = ("q_left", "q_right", "q_combined", "activation_grad")
_RESERVED_NAMES = ("tl", "triton", "math", "torch", "y", "b", "activation", *RULE_PARTS,
                  *(f"{p}_twin" for p in RULE_PARTS), "float", "int", "abs", "min", "max")


@dataclass
class Form:
    """q(y) = expression(y; coefficients), optionally after named intermediate assignments
    (name = expr, in order; later ones and the expression may use earlier names)."""

    expression: sp.Expr
    coefficients: dict[str, float] = field(default_factory=dict)
    assignments: tuple[tuple[str, sp.Expr], ...] = ()

    @classmethod
    def parse(cls, text: str, coefficients: dict[str, float] | None = None, assignments=(),
              variables: tuple[str, ...] = ("y",)) -> Form:
        """Parse a form with the restricted grammar (never evaluated): ``y``, the coefficient names, the names of
        earlier assignments, numbers and the functions of :func:`.backends.grammar` ("form")."""
        coefficients = dict(coefficients or {})
        known = {**grammar("form"), "y": y, **{v: sp.Symbol(v) for v in variables if v != "y"}}
        for name in [*coefficients, *(n for n, _ in assignments)]:
            if (not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name) or name in known
                    or name in _RESERVED_NAMES or name.startswith("_")):
                raise ValueError(f"form name {name!r} must be a new identifier: not a Python keyword, not y, b or "
                                 f"a function name, not one the generated kernels use ({', '.join(_RESERVED_NAMES)}) "
                                 "and not starting with _")
        names = {**known, **{k: sp.Symbol(k) for k in coefficients}}  # 'beta', 'gamma' are names, not functions
        parsed = []
        for n, e in assignments:
            parsed.append((n, parse_expression(e, names, f"assignment {n}")))
            names[n] = sp.Symbol(n)
        return cls(parse_expression(text, names, "form expression"), coefficients, tuple(parsed))

    @classmethod
    def from_table(cls, branch, variables: tuple[str, ...] = ("y",)) -> Form:
        """The form of one branch (a :class:`~.tables.Branch`: expression, coefficients, assignments) of an invact
        table; the table's ``combined`` form q(y, b) (b = 1 on the left branch) takes ``variables=("y", "b")``."""
        return cls.parse(branch.expression, branch.coefficients, branch.assignments, variables)

    def full(self) -> sp.Expr:
        """The expression with every assignment substituted (a shared DAG in memory; never print or walk
        it as a tree)."""
        expr = self.expression
        for name, value in reversed(self.assignments):
            expr = expr.xreplace({sp.Symbol(name): value})
        return expr

    def compile(self, modules, args=(), prepare=lambda e: e):
        """A callable (y, *args) evaluating the assignments in order, then the expression, as a kernel would
        (never expanded). ``prepare`` maps each part before stable_form and lambdify."""
        names, steps = [y, *args], []
        for name, value in self.assignments:
            steps.append(sp.lambdify(names, stable_form(prepare(value)), modules=modules))
            names = [*names, sp.Symbol(name)]
        final = sp.lambdify(names, stable_form(prepare(self.expression)), modules=modules)

        def run(*env):
            env = list(env)
            for step in steps:
                env.append(step(*env))
            return final(*env)

        return run

    @cached_property
    def _fn(self):
        return self.compile(numpy_namespace(), [sp.Symbol(k) for k in self.coefficients])

    @property
    def values(self) -> dict:
        """The coefficients as 17-digit sympy Floats keyed by their symbols (what evaluators and kernels put in)."""
        return {sp.Symbol(k): sp.Float(v, 17) for k, v in self.coefficients.items()}

    def with_values(self, e: sp.Expr) -> sp.Expr:
        """A part of the form with the coefficient values in place, constants to 17 digits: what torch evaluates
        (torch_fn lambdifies it; ``approxbp export`` prints it into the generated twin)."""
        return e.xreplace(self.values).evalf(17)

    def torch_fn(self, args=()):
        """A torch callable q(y, *args) with the coefficients in place (float64 constants)."""
        return self.compile([torch_namespace()], args, prepare=self.with_values)

    def __call__(self, yv, coefficients: dict[str, float] | None = None) -> np.ndarray:
        c = self.coefficients if coefficients is None else coefficients
        yv = np.asarray(yv, dtype=np.float64)
        with np.errstate(all="ignore"):
            return np.broadcast_to(self._fn(yv, *c.values()), yv.shape).astype(np.float64)

    def substituted(self) -> sp.Expr:
        """The full expression with the coefficient values in place (what code generation prints)."""
        return self.full().xreplace(self.values)

    def latex(self) -> str:
        """LaTeX of the full expression with the coefficients in place (assignments substituted)."""
        return sp.latex(self.substituted())

    def operations(self) -> int:
        """Operations of the assignments and the expression, each after common-subexpression elimination
        (sympy cse + count_ops): what a kernel computes per element."""
        total = 0
        for e in [v for _, v in self.assignments] + [self.expression]:
            subs, (reduced,) = sp.cse(e.xreplace(self.values))
            total += int(sum(sp.count_ops(x) for _, x in subs) + sp.count_ops(reduced))
        return total

    def to_json(self, domain=None) -> dict:
        """The table branch object; ``domain`` is left out for the combined form, which covers every y."""
        out = {"expression": str(self.expression), "coefficients": dict(self.coefficients),
               "operations": self.operations()}
        if domain is not None:
            out["domain"] = [float(domain[0]), float(domain[1])]
        if self.assignments:
            out["assignments"] = [[n, str(e)] for n, e in self.assignments]
        return out


# ---- metrics ------------------------------------------------------------------------------------
def branch_grid(ia: InvertedActivation, branch: str, n: int = GRID) -> tuple[np.ndarray, np.ndarray]:
    """(y, dy-weights) on a branch: uniform in s = √t (dense at the turning point)."""
    check_branch(branch)
    t_max = (ia.left_limit - ia.f_T) if branch == "left" else RIGHT_SPAN
    s = np.linspace(0.0, 1.0, n)
    t = s * s * t_max
    yv = ia.f_T + t
    yv[0] = ia.f_T
    if branch == "left":
        yv[-1] = ia.left_limit
    w = np.gradient(t)  # trapezoid-like dy weights
    return yv, w


def _left_tail(ia: InvertedActivation, n: int = 4001) -> tuple[np.ndarray, np.ndarray]:
    """(y, g) at y = f(x), x = T − 10^[−3, 3] log-spaced: the left branch's open end, where g = f′(x) is known
    without inverting."""
    xv = ia.T - np.geomspace(1e-3, 1e3, n)
    return ia.activation.f(xv), ia.activation.df(xv)


def right_tail_error(ia: InvertedActivation, n: int = 4001) -> float:
    """max |h′(y) − g(y)| beyond the right domain (y ≥ f(T) + RIGHT_SPAN, x up to 10^6): the error of the rule the
    kernels use there (q = h′(y), :func:`backward_rule`), sampled in x so that g = f′(x) needs no inversion."""
    y_max = ia.f_T + RIGHT_SPAN
    xv = np.concatenate([np.linspace(y_max - 1.0, y_max + 50.0, n), np.geomspace(y_max + 50.0, 1e6, 200)])
    yv = ia.activation.f(xv)
    keep = yv > y_max
    at_switch = abs(float(ia.activation.df(np.array([y_max]))[0] - ia.g(np.array([y_max]), "right")[0]))
    return max(at_switch, float(np.max(np.abs(ia.activation.df(yv[keep]) - ia.activation.df(xv[keep])))))


def branch_metrics(ia: InvertedActivation, q, branch: str) -> tuple[float, float]:
    """(L∞, L2) of q against g on ``branch`` (see the module docstring)."""
    yv, w = branch_grid(ia, branch)
    err = ia.g(yv, branch) - q(yv)
    ty, tg = _left_tail(ia) if branch == "left" else (yv[:0], yv[:0])
    every = np.concatenate([err, tg - q(ty)])  # the L∞ points; L2 stays on the grid's dy weights
    if not np.all(np.isfinite(every)):
        raise ValueError(f"the approximation is not finite everywhere on the {branch} branch")
    return float(np.max(np.abs(every))), float(np.sqrt(np.sum(w * err * err) / np.sum(w)))


# ---- the published forms (Inverted Activations eqs. 5–9, App. A.2, and the authors' released code) ------
def _t(ia):
    return y - sp.Float(ia.f_T, 17)


def published_forms(activation: str, ia: InvertedActivation) -> dict[str, tuple[Form, Form, str]]:
    """name → (left form, right form, reference) for gelu and silu."""
    t = _t(ia)
    c = sp.symbols("c0:8")
    right_core = 1 + (c[0] + c[1] * sp.sqrt(t) + c[2] * t) * sp.exp(c[3] * (c[4] - t) ** 3)  # eq. 6
    if activation == "gelu":
        eq5 = c[0] * sp.sqrt(y + c[1]) * (2 * y + c[2] * sp.sqrt(-y)) * (
            sp.Abs(c[3] * y**2 + sp.Abs(c[4] * y + c[5]) + c[6]) + c[7])
        left_a2 = dict(zip([s.name for s in c], [1.6311011311381, 0.169972466666667, -0.06261728, 1.2947087,
                                                  1.98055565, 0.22730362, -0.038978495, 1.3295193]))
        right_rel = {"c0": -1.383717971214795, "c1": 1.5584201843500274, "c2": 0.04404574801811055,
                     "c3": 0.03214673676937606, "c4": -2.1198850898439496}
        A, B, al, be = sp.symbols("A B alpha beta")
        u = t / sp.Float(-ia.f_T, 17)
        released_left = Form(B + A * u**al * (1 - u) ** be,
                             {"A": -0.2964121012745849, "B": 0.0012176597919768537,
                              "alpha": 0.44236329315571304, "beta": 0.8312705290392689})
        return {
            "paper": (Form(eq5, left_a2), Form(right_core, right_rel),
                      "Inverted Activations eqs. 5, 6 with App. A.2 coefficients (eq. 10, 11)"),
            "released": (released_left, Form(right_core, right_rel),
                         "authors' released GELU constants: left B + A·u^α(1−u)^β, right eq. 6"),
        }
    if activation == "silu":
        left = Form((c[0] + c[1] * sp.sqrt(t) + c[2] * t + c[3] * t**2) * (1 - y) + y,  # eq. 7
                    {"c0": 0.21717700759576886, "c1": -0.5076843705082636, "c2": 0.07963139766917564,
                     "c3": 0.3574942048593756})
        right = Form(right_core * (1 - y) + y,  # eq. 8
                     {"c0": -1.3108564021309803, "c1": 0.8485896470316523, "c2": -0.16299051259510922,
                      "c3": 0.0026961639850448835, "c4": -5.770613302664509})
        return {"paper": (left, right, "Inverted Activations eqs. 7, 8 with the authors' released SiLU constants")}
    raise ValueError(f"the paper publishes forms for gelu and silu only, not {activation!r}")


def newton_form(ia: InvertedActivation, branch: str, degree: int, steps: int = 1) -> Form:
    """Our form: x₀ = T ± s·P(s)/Q(s) with s = √(y − f(T)) (the turning point's √ behaviour built in),
    then ``steps`` damped Newton steps x ← x − (f(x) − y)·f'(x)/(f'(x)² + ε²), ε = 1e-5, and q = f'(x).
    Where |f'| ≫ ε this is Newton (error squared); at the turning point, where f(x) − y cancels, the step
    vanishes and the √t-exact initial guess stands. Coefficients p0…, r1…"""
    act = ia.activation
    # t ≥ 0 and w ≥ 0 in exact arithmetic; the Max keep each √ real where the stored decimals of f(T) and t_max
    # round them a few ulps below 0 at the turning point
    s = sp.sqrt(sp.Max(0, _t(ia)))
    p = sp.symbols(f"p0:{degree + 1}")
    r = sp.symbols(f"r1:{degree + 1}")
    P = sum(pi * s**i for i, pi in enumerate(p))
    Q = 1 + sum(ri * s ** (i + 1) for i, ri in enumerate(r))
    delta = s * P / Q
    coeffs = [*p, *r]
    if branch == "left":  # the open end y → lim f: f⁻¹ → −∞ like a power of w = −log(1 − t/t_max)
        b = sp.symbols("b1:3")
        w = -sp.log(sp.Max(1 - _t(ia) / sp.Float(ia.left_limit - ia.f_T, 17), sp.Float(1e-30)))
        delta += b[0] * w + b[1] * sp.sqrt(sp.Max(0, w)) * s  # both vanish like s² at the turning point
        coeffs += list(b)
    x0 = sp.Float(ia.T, 17) + (1 if branch == "right" else -1) * delta
    return with_newton_steps(act, x0, {k.name: 0.0 for k in coeffs}, steps)


def with_newton_steps(act, x0: sp.Expr, coefficients: dict[str, float], steps: int) -> Form:
    """The form x₀(y), then ``steps`` damped Newton steps x_{k+1} = x_k − (f(x_k) − y)·d_k/(d_k² + ε²) with
    d_k = f′(x_k), ε = NEWTON_EPS, and q = f′(x_n): the structure ``approxbp certify`` recognises (NewtonSteps) and
    whose error it propagates."""
    from .activations import x as X

    f, df = act.expr, act.derivative_expr(1)
    assignments = [("x0", x0)]
    for k in range(steps):
        xk, dk = sp.Symbol(f"x{k}"), sp.Symbol(f"d{k}")
        assignments.append((f"d{k}", df.subs(X, xk)))
        assignments.append((f"x{k + 1}", xk - (f.subs(X, xk) - y) * dk / (dk**2 + sp.Float(_NEWTON_EPS**2))))
    return Form(df.subs(X, sp.Symbol(f"x{steps}")), coefficients, tuple(assignments))


#: The rule's opaque parts: each evaluator binds them (torch: the compiled forms and h′; Triton: the generated
#: module's jit functions of these names).
_Q_LEFT, _Q_RIGHT, _Q_COMBINED, _H_GRAD = (sp.Function(n) for n in RULE_PARTS)


def backward_rule(t) -> sp.Expr:
    """q_s(y) of an invact table as one sympy expression in y and b (b = 1 on the left branch, x < T), for
    dx = dy · q_s(y) (Inverted Activations §2): the one home of the rule, which TableBackward lambdifies for torch
    and kernels/codegen prints into Triton. y is first clamped to ≥ f(T) (rounding may put it below). With a
    ``combined`` form q = q_combined(y, b). Otherwise q = q_left(min(y, left_max)) on the left; on the right
    q = h′(y) beyond right_max (the tail rule) and q_right(min(y, right_max)) below. A monotone table has the right
    branch only, for every y (a derived one without the tail rule: its q holds everywhere)."""
    y, b = sp.symbols("y b")
    yc = sp.Max(y, sp.Float(t.f_T, 17))
    if t.combined is not None:
        return _Q_COMBINED(yc, b)
    if t.monotone and t.source == "derived":  # one branch, exact for every y: no tail rule, b never read
        return _Q_RIGHT(yc)
    right_max = sp.Float(t.right.domain[1], 17)
    right = select(yc - right_max, _H_GRAD(yc), _Q_RIGHT(sp.Min(yc, right_max)))
    if t.monotone:  # one branch: b is never read (no bit is saved)
        return right
    return select(b, _Q_LEFT(sp.Min(yc, sp.Float(t.left.domain[1], 17))), right)


class TableBackward:
    """:func:`backward_rule` for torch tensors: q = rule(y, left) with y in float32 (float64 stays float64)."""

    def __init__(self, t):
        parts = {"q_right": Form.from_table(t.right).torch_fn(),
                 "activation_grad": get_activation(t.expression).torch_fn(1)}
        if t.left is not None:
            parts["q_left"] = Form.from_table(t.left).torch_fn()
        if t.combined is not None:
            parts["q_combined"] = Form.from_table(t.combined, ("y", "b")).torch_fn([sp.Symbol("b")])
        self._rule = sp.lambdify(sp.symbols("y b"), backward_rule(t), modules=[parts, torch_namespace()])

    def __call__(self, y, left):
        """q for saved outputs ``y`` and branch flags ``left`` (bool, True where x < T)."""
        import torch

        y = y.to(torch.promote_types(y.dtype, torch.float32))
        return self._rule(y, left.to(y.dtype))
