"""Activations as sympy expressions in ``x``: the one source of truth.

Every evaluator (numpy, torch, mpmath) and every derivative is derived from the expression with
sympy (``diff`` + ``lambdify``); nothing is written twice by hand.
"""

from __future__ import annotations

import difflib
import functools
from dataclasses import dataclass, field
from typing import Any

import mpmath
import numpy as np
import sympy as sp

from .backends import grammar, mpmath_namespace, numpy_namespace, rough_functions, torch_namespace
from .expressions import parse as parse_expression
from .expressions import readable
from .files import SAFE_NAME
from .functions import Phi
from .rewrites import stable_form

__all__ = ["Activation", "get_activation", "known_form", "list_activations", "MONOTONE", "named_activation",
           "named_expression", "PIECEWISE", "REGISTRY", "x"]


x = sp.Symbol("x", real=True)

#: Registry of named activations. gelu = x·Φ(x) is the erf form of Approx-BP eq. 40; gelu_tanh is
#: x/2·(1 + tanh(√(2/π)(x + 0.044715x³))) written as x·σ(2√(2/π)(x + 0.044715x³)) (the same function,
#: free of cancellation); silu is eq. 47; quick_gelu = x·σ(1.702x); mish = x·tanh(softplus(x)).
REGISTRY: dict[str, str] = {
    "gelu": "x*Phi(x)",
    "gelu_tanh": "x*sigmoid(2*sqrt(2/pi)*(x + 0.044715*x**3))",
    "silu": "x*sigmoid(x)",
    "quick_gelu": "x*sigmoid(1.702*x)",
    "mish": "x*tanh(log(1 + exp(x)))",
}

#: Piecewise activations: not smooth, so no ReLU-sum or InvAct fit takes them (those fits need h′ and h″), but exact
#: tables derived from the expression, piece by piece, serve them (``fitting.invact_exact``: ReLU², f′(f⁻¹(y)) = 2√y;
#: ELU, select(y, 1, y + 1); SELU, select(y, λ, y + λα)), and FewBit's free levels fit them.
#: CELU with torch's default α = 1 is ELU; SELU's λ and α are torch's.
PIECEWISE: dict[str, str] = {
    "relu2": "Max(0, x)**2",
    "elu": "Max(0, x) + Min(0, exp(x) - 1)",
    "celu": "Max(0, x) + Min(0, exp(x) - 1)",
    "selu": "1.0507009873554804934193349852946*(Max(0, x) + Min(0, 1.6732632423543772848170429916717*(exp(x) - 1)))",
    "hardswish": "x*Min(Max(x + 3, 0), 6)/6",  # 0 below −3, x above 3: eq. 13's ReLU-sum fits it exactly there
    # non-decreasing with constant pieces: one exact branch, q = 0 at the constants (torch saves their input)
    "hardsigmoid": "Min(Max(x/6 + 1/2, 0), 1)",
    "relu6": "Min(Max(x, 0), 6)",
    "hardtanh": "Min(Max(x, -1), 1)",
}
#: Increasing activations with inf f = 0: the inverted-activation family serves them with one exact branch and no
#: bit (``fitting.invact_exact.monotone_table``: softplus f′(f⁻¹(y)) = 1 − e^(−y)); patching uses that table in
#: either mode. (Their ReLU-sum fits are the user's: pass the expression.)
MONOTONE: dict[str, str] = {
    "softplus": "log(1 + exp(x))",
}


def named_expression(name: str) -> str | None:
    """The expression of a named activation (:data:`REGISTRY`, :data:`PIECEWISE`, :data:`MONOTONE`), else None."""
    return REGISTRY.get(name) or PIECEWISE.get(name) or MONOTONE.get(name)

def _allowed_functions() -> dict:
    """The activation grammar: :func:`.backends.grammar` ("activation"), ``Piecewise`` (nested selects:
    :func:`.functions.piecewise`) and the variable x."""
    from .functions import piecewise

    return {**grammar("activation"), "Piecewise": piecewise, "x": x}


def _parse(text: str) -> sp.Expr:
    """Parse ``text`` into a sympy expression in x with the restricted grammar (never evaluated), failing with
    the position or the construct at fault; refuse non-smooth functions and singular expressions. Cached per
    function set, so that adding or removing a function (:mod:`.backends`) is seen at once."""
    from . import backends

    return _parse_with(text, tuple(sorted(backends.FUNCTIONS)))


@functools.lru_cache(maxsize=256)
def _parse_with(text: str, functions: tuple[str, ...]) -> sp.Expr:
    expr = parse_expression(text, _allowed_functions(), "activation expression")
    rough = sorted({type(a).__name__ for a in sp.preorder_traversal(expr)} & set(rough_functions()))
    if rough and expr not in _piecewise_exprs():
        from .pieces import kinks

        try:  # piecewise (Max, Min, Abs, Heaviside): smooth between kinks that sympy locates exactly
            kinks(expr)
        except (ValueError, TypeError, NotImplementedError) as err:
            raise ValueError(f"activation expression {text!r} is piecewise ({', '.join(rough)}) but its kinks "
                             f"cannot be located in closed form ({err}); the fits split at them") from None
    if expr.free_symbols - {x}:
        raise ValueError(f"activation expression {text!r} has symbols other than x: {expr.free_symbols - {x}}")
    if x not in expr.free_symbols:
        raise ValueError(f"activation expression {text!r} is not a function of x")
    _check_finite(text, expr)
    return expr


@functools.cache
def _piecewise_exprs() -> tuple:
    return tuple(parse_expression(t, _allowed_functions(), "activation expression") for t in PIECEWISE.values())


def _float_integers(e: sp.Expr) -> sp.Expr:
    """Integers beyond 2^53 as float64 constants: numpy would otherwise see Python ints past int64 and fall back to
    object arrays."""
    big = {n: sp.Float(n, 17) for n in e.atoms(sp.Integer) if abs(n) > 2**53}
    return e.xreplace(big) if big else e


def _singular_points(expr: sp.Expr) -> list[tuple[str, float]]:
    """Real x where a denominator vanishes, a log's argument is ≤ 0 or a square root's is < 0, for every such
    argument that is a rational function of x (exact: the real roots of its numerator, wherever they are, not only
    on a sampling grid). Other arguments are left to the sampling in :func:`_check_finite`."""
    found = []
    for sub in sp.preorder_traversal(expr):
        if isinstance(sub, sp.Pow) and sub.exp.is_negative:
            arg, what = sub.base, "a denominator vanishes"
        elif isinstance(sub, sp.log):
            arg, what = sub.args[0], "a log's argument is 0"
        elif isinstance(sub, sp.Pow) and sub.exp.is_Rational and sub.exp.q % 2 == 0:
            arg, what = sub.base, "a square root's argument changes sign"
        else:
            continue
        num, _ = sp.fraction(sp.together(arg))
        if x not in num.free_symbols or not num.is_polynomial(x):
            continue
        try:
            roots = [float(r) for r in sp.Poly(num, x).real_roots()]
        except (sp.PolynomialError, NotImplementedError, ValueError):
            continue
        found += [(what, r) for r in roots]
    return found


def _check_finite(text: str, expr: sp.Expr) -> None:
    """h and h′ must be finite everywhere: exact real roots of every rational denominator, log and square-root
    argument (any x, e.g. the pole of 1e-9/(x − 0.005) between grid points), then samples of h and h′ on
    x ∈ [−30, 30] for the rest (1/x, log(x), x/(x−1), …)."""
    for what, at in _singular_points(expr):
        raise ValueError(f"activation expression {text!r} is singular: {what} at x = {at:.6g}")
    grid = np.linspace(-30.0, 30.0, 6001)
    for order in (0, 1):
        e = _float_integers(stable_form(sp.diff(expr, x, order) if order else expr))
        with np.errstate(all="ignore"):
            v = np.broadcast_to(sp.lambdify(x, e, modules=numpy_namespace())(grid), grid.shape)
        bad = ~np.isfinite(v)
        if bad.any():
            raise ValueError(f"activation expression {text!r} is singular: h{chr(0x2032) * order}(x) is not finite "
                             f"at x = {grid[bad][0]:g}")


@dataclass(frozen=True)
class Activation:
    """An activation h(x) given by a sympy expression; derivatives and evaluators are derived."""

    name: str
    expr: sp.Expr
    _cache: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_expression(cls, name: str, expression: str) -> Activation:
        """Rebuild from a name and its recorded expression (e.g. in a worker process or from a table)."""
        return cls(name, _parse(expression))

    @property
    def expression(self) -> str:
        """The sympy ``str`` of h (what tables record)."""
        return str(self.expr)

    @property
    def readable(self) -> str:
        """h as a person typed it: the exact decimals the parser made rationals (1.702 → 851/500) written as
        decimals again, so that 1.0507009873554805 is not echoed as 2101401974710961/2000000000000000."""
        return readable(self.expr)

    def derivative_expr(self, order: int = 1) -> sp.Expr:
        """h^(order) by sympy; a piecewise h's unit steps with their arguments made exact
        (:func:`.pieces.sharpen`: eˣ·H(1 − eˣ) is eˣ·H(−x))."""
        key = f"d{order}"
        if key not in self._cache:
            d = sp.diff(self.expr, x, order)
            if d.has(sp.Heaviside):
                from .pieces import sharpen

                d = sharpen(d)
            self._cache[key] = d
        return self._cache[key]

    # ---- evaluators -------------------------------------------------------------------------
    def _numpy(self, order: int):
        key = f"np{order}"
        if key not in self._cache:
            e = _float_integers(stable_form(self.derivative_expr(order) if order else self.expr))
            fn = sp.lambdify(x, e, modules=numpy_namespace())

            def call(v, fn=fn):
                v = np.asarray(v, dtype=np.float64)
                with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
                    return np.broadcast_to(fn(v), v.shape).astype(np.float64)

            self._cache[key] = call
        return self._cache[key]

    def f(self, v):
        """h(x), float64 numpy."""
        return self._numpy(0)(v)

    def df(self, v):
        """h'(x), float64 numpy."""
        return self._numpy(1)(v)

    def d2f(self, v):
        """h''(x), float64 numpy."""
        return self._numpy(2)(v)

    def mp(self, v, order: int = 0, dps: int | None = 50):
        """h^(order)(v) in mpmath at ``dps`` digits (None: the caller's mpmath precision, v unrounded)."""
        key = f"mp{order}"
        if key not in self._cache:
            e = stable_form(self.derivative_expr(order) if order else self.expr)
            self._cache[key] = sp.lambdify(x, e, mpmath_namespace())
        if dps is None:
            return self._cache[key](v if isinstance(v, mpmath.mpf) else mpmath.mpf(v))
        with mpmath.workdps(dps):
            return self._cache[key](mpmath.mpf(v))

    def torch_expr(self, order: int = 0) -> sp.Expr:
        """What the torch evaluators compute for h^(order): the stable form, constants to 17 digits (torch_fn
        lambdifies it; ``approxbp export`` prints it into the generated module's twin)."""
        return stable_form(self.derivative_expr(order) if order else self.expr).evalf(17)

    def torch_fn(self, order: int = 0):
        """A torch callable for h^(order) built from the expression (constants to float64 precision)."""
        key = f"torch{order}"
        if key not in self._cache:
            self._cache[key] = sp.lambdify(x, self.torch_expr(order), modules=[torch_namespace()])
        return self._cache[key]

    # ---- asymptotics ------------------------------------------------------------------------
    def kinks(self) -> list[float]:
        """Where a piecewise h switches piece (:func:`.pieces.kinks`); [] for a smooth one."""
        from .pieces import kinks

        return kinks(self.expr)

    def relu_sum_limits(self) -> list[str]:
        """Why eq. 13 cannot match h (h(x) → 0 as x → −∞, h(x) − x → 0 as x → +∞, at any rate: exponential, double
        exponential or algebraic, :mod:`.tails`), one reason per side; [] when it can."""
        from .tails import tail

        return [s.describe() for s in (tail(self, 0, side) for side in ("left", "right")) if not s.vanishes]

    def check_relu_sum_asymptotics(self, bits: int | None = None) -> None:
        """Refuse h unless eq. 13 can match its limits (:meth:`relu_sum_limits`), naming the family that fits it."""
        if problems := self.relu_sum_limits():
            invact = (f"{self.fit_command('invact')} (h does not decrease: its saved output alone gives h′, exact "
                      "where each piece has a closed-form inverse), or " if self.non_decreasing() else "")
            raise ValueError(
                f"activation {self.name!r} cannot be approximated by a sum of ReLUs with Σw=1, Σw·c=0 "
                f"(Approx-BP eq. 13): " + "; ".join(problems) + f". A way forward: {invact}"
                f"{self.fit_command('relu-sum', '--levels free', bits=bits or 2)} (FewBit's free levels fit h′ with "
                "no condition at ±∞)")

    def non_decreasing(self) -> bool:
        """h′ ≥ 0 on [−60, 60] (a grid of 4001 points, the tables' check of a monotone table: ``table_checks``'s
        MONOTONE_SPAN): the inverted-activation family's one-branch tables apply."""
        with np.errstate(all="ignore"):
            return bool(np.all(self.df(np.linspace(-60.0, 60.0, 4001)) >= 0))

    def relu_sum_way_forward(self, bits: int = 2) -> str:
        """The ReLU-sum fit that takes h, with why: eq. 13's when its limits hold, else FewBit's free levels."""
        if self.relu_sum_limits():
            return (self.fit_command("relu-sum", "--levels free", bits=bits)
                    + " (FewBit's free levels: eq. 13's limits do not hold)")
        return self.fit_command("relu-sum", bits=bits) + " (eq. 13's limits hold)"

    def fit_command(self, family: str, *options: str, bits: int | None = None) -> str:
        """The ``approxbp fit`` command line for this activation (its registry name, else its expression)."""
        given = self.name if named_expression(self.name) else self.readable
        return " ".join(["approxbp fit", family, *options, "--activation", f"'{given}'",
                         *([f"--bits {bits}"] if bits else [])])


def get_activation(name_or_expr: str | Activation) -> Activation:
    """Look up a registry name (case-insensitive) or parse a sympy expression string in x."""
    if isinstance(name_or_expr, Activation):
        return name_or_expr
    if not isinstance(name_or_expr, str) or not name_or_expr.strip():
        raise TypeError(f"activation must be a registry name or an expression string in x, got {name_or_expr!r}")
    key = name_or_expr.strip().lower()
    if named_expression(key):
        return Activation(key, _parse(named_expression(key)))
    allowed = _allowed_functions()
    if name_or_expr.strip().isidentifier() and name_or_expr.strip() not in allowed:
        names = [*REGISTRY, *PIECEWISE, *MONOTONE]
        near = difflib.get_close_matches(key, names + [n for n in allowed if callable(allowed[n])], n=1)
        raise ValueError(
            f"unknown activation {name_or_expr!r}" + (f" (did you mean {near[0]!r}?)" if near else "")
            + f"; named: {', '.join(names)}; or pass an expression in x, e.g. 'x*tanh(log(1+exp(x)))'"
        )
    text = name_or_expr.strip()
    fn = allowed.get(text)
    if callable(fn) and not isinstance(fn, sp.Basic):  # a bare function name: f(x)
        text = f"{text}(x)"
    known = known_form(text)
    return Activation(name_or_expr.strip(), _parse(REGISTRY[known] if known else text))


#: Where :func:`known_form` compares an expression with the registry's: h and h′ at 30 digits.
_SAME_POINTS = tuple(-12 + 24 * i / 64 for i in range(65))


@functools.lru_cache(maxsize=256)
def known_form(text: str) -> str | None:
    """The registry activation that the expression ``text`` is (a user's GELU written x·erfc(−x/√2)/2,
    which sympy turns into the cancelling x·(2 − erfc(x/√2))/2, is evaluated, fitted and generated from the
    packaged x·Φ(x)), else None. Equal when sympy finds h − h_known = 0 (both in erf/exp), or, where sympy cannot
    decide, when h and h′ agree to 1e-15 (relative, absolute below 1: float64 cannot tell them apart) at 30 digits
    on 65 points of [−12, 12] (so 0.70710678118654757·x is taken for x/√2)."""
    act = Activation(text, _parse(text))
    for name in REGISTRY:
        known = _packaged(name)
        if act.expr == known.expr:
            return None  # already the packaged form
        if _same_function(act, known):
            return name
    return None


@functools.cache
def _packaged(name: str) -> Activation:
    """A registry activation, built (and its evaluators compiled) once per process for :func:`known_form`."""
    return Activation(name, _parse(REGISTRY[name]))


def _same_function(a: Activation, b: Activation) -> bool:
    with np.errstate(all="ignore"):  # a float64 screen first: most candidates differ at once
        if not np.allclose(a.f(np.array(_SAME_POINTS[::8])), b.f(np.array(_SAME_POINTS[::8])), rtol=1e-9,
                           atol=1e-9):  # absolute too: a cancelling form is 0 where the other is 1e-32
            return False
    as_erf = lambda e: e.replace(Phi, lambda z: (1 + sp.erf(z / sp.sqrt(2))) / 2).rewrite(sp.erf)  # noqa: E731
    try:
        if sp.simplify(as_erf(a.expr) - as_erf(b.expr)) == 0:
            return True
    except (TypeError, ValueError, NotImplementedError):
        pass
    with mpmath.workdps(30):
        for v in _SAME_POINTS:
            for order in (0, 1):
                p, q = a.mp(mpmath.mpf(v), order, None), b.mp(mpmath.mpf(v), order, None)
                if abs(p - q) > mpmath.mpf(10) ** -15 * max(abs(q), 1):
                    return False
    return True


def named_activation(activation: str, name: str | None = None) -> Activation:
    """``activation`` (a registry name or an expression) under the label ``name``, for tables, reports and file
    names: ``named_activation("x*sigmoid(1.5*x)", "swish1.5")``. A registry name is refused as a label for a
    different function. The name must be a :data:`~.files.SAFE_NAME` that starts with a letter."""
    act = get_activation(activation)
    if name is None:
        return act
    if not isinstance(name, str) or not (SAFE_NAME.fullmatch(name) and name[0].isalpha()):
        raise ValueError(f"activation name {name!r} must match {SAFE_NAME.pattern} and start with a letter "
                         "(letters, digits, _ . + -; at most 64 characters)")
    registered = named_expression(name.lower())
    if registered is not None and _parse(registered) != act.expr:
        raise ValueError(f"{name!r} is the registry's {registered}, not {act.expression}; choose another name")
    return Activation(name, act.expr)


def list_activations() -> list[str]:
    return list(REGISTRY)
