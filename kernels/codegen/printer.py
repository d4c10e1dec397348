"""A small sympy→Triton printer: it lowers an activation's expression to operations that run both compiled and
under ``TRITON_INTERPRET=1`` (``tl.math.erf``, ``tl.exp``, ``tl.log``, ``tl.sqrt``): ``tanh`` and
``log(1 + exp(u))`` become overflow-safe exp/log forms, constants keep full float64 digits, negative powers become
the helpers' reciprocals (compiled float32 divides by one MUFU.RCP, ``_rcp``)."""

from __future__ import annotations

import sympy as sp
import torch
from approxbp.approximations import backends
from approxbp.approximations.functions import select, softplus
from approxbp.approximations.invact_forms import RULE_PARTS
from approxbp.approximations.rewrites import stable_form
from sympy.printing.pycode import PythonCodePrinter

__all__ = ["by_storage_dtype", "horner", "lower", "round_down", "round_up", "tanh_series", "triton_source",
           "TritonPrinter"]


_rcp = sp.Function("_rcp")  # 1/u (helpers: one MUFU.RCP in compiled float32)
_rsqrt = sp.Function("_rsqrt")  # 1/√u


class TritonPrinter(PythonCodePrinter):
    """Prints a sympy expression in ``x`` as a Triton (tl.*) expression. ``lowp``: Φ prints as ``_phi(u, LOWP)``
    (the enclosing jit function has a ``LOWP`` constexpr: 16-bit data)."""

    def __init__(self, lowp: bool = False):
        super().__init__()
        self.lowp = lowp

    def doprint(self, expr, *args, **kwargs):  # every expression printed gets the helpers' reciprocals
        return super().doprint(_reciprocals(expr), *args, **kwargs)

    def _print_Float(self, e):
        return repr(float(e))

    def _print_Rational(self, e):
        return repr(float(e))

    def _print_Integer(self, e):
        return repr(float(e))

    def _print_NumberSymbol(self, e):
        return repr(float(e))

    _print_Pi = _print_Exp1 = _print_NumberSymbol

    def _print_Pow(self, e, rational=False):
        base, exp = e.args
        if exp.is_Float and float(2 * exp).is_integer():  # evalf turns √ into **0.5
            exp = sp.Rational(int(2 * exp), 2)
        if exp == sp.Rational(1, 2):
            return f"tl.sqrt({self._print(base)})"
        if exp.is_Rational and exp.q == 2 and 0 < exp < 4:  # b^{n+1/2} = b^n·√b
            return " * ".join([f"tl.sqrt({self._print(base)})"] + [self.parenthesize(base, 100)] * int(exp))
        if exp.is_Integer and 1 < int(exp) <= 4:
            return "(" + " * ".join([self.parenthesize(base, 100)] * int(exp)) + ")"
        return f"tl.exp({self._print(exp)} * tl.log({self._print(base)}))"  # negative powers: see reciprocals()

    def _fn(self, name, e):
        return f"{name}({', '.join(self._print(a) for a in e.args)})"

    def _print(self, expr, **kwargs):
        """Function applications print by their Triton form in the function set (approximations.backends); one
        without a form is refused, never printed as ``math.<name>(…)`` (which fails at the first launch)."""
        if not getattr(expr, "is_Function", False):
            return super()._print(expr, **kwargs)
        fn = backends.FUNCTIONS.get(type(expr).__name__)
        if fn is None:
            return self._print_Function(expr)
        if fn.triton is None:
            return self._refuse(expr)
        if callable(fn.triton):
            return fn.triton(self, expr)
        return fn.triton.format(*(self._print(a) for a in expr.args))

    def _print_Function(self, e):
        name = type(e).__name__
        if name in RULE_PARTS:  # the module's own jit functions
            return self._fn(name, e)
        if name in ("_rcp", "_rsqrt"):
            return self._fn({"_rsqrt": "tl.math.rsqrt"}.get(name, name), e)
        return self._refuse(e)

    def _refuse(self, e, *args, **kwargs):
        raise ValueError(f"cannot lower {type(e).__name__} to Triton (export refuses it); supported: "
                         f"{', '.join(f.name for f in backends.functions(triton=True))} and powers")


def lower(expr: sp.Expr) -> sp.Expr:
    """The shared stable form (approximations.rewrites.stable_form), then Mish's tanh(softplus(u)) → n/(n + 2)
    with n = e^u(e^u + 2) (the same function: one exp and one division instead of exp, log, exp and two divisions;
    no cancellation as u → −∞; 1 for u > 20, where it rounds to 1 and e^{2u} would overflow)."""
    u = sp.Wild("u")

    def tanh_softplus(u):
        n = sp.exp(u) * (sp.exp(u) + 2)
        return select(u - 20, sp.Integer(1), n / (n + 2))

    return stable_form(expr).replace(sp.tanh(softplus(u)), tanh_softplus)


def _reciprocals(expr: sp.Expr) -> sp.Expr:
    """Negative powers as the helpers' reciprocals: b^−n → _rcp(bⁿ) (n = 1 … 4), b^−½ → _rsqrt(b) (exponents may be
    floats after evalf); other negative powers stay exp(p·log b). TritonPrinter.doprint applies it."""
    def fast(e):
        p = float(e.exp)
        if p == -0.5:
            return _rsqrt(e.base)
        if p.is_integer() and -4 <= p <= -1:
            return _rcp(e.base ** int(-p))
        return e

    return expr.replace(lambda e: e.is_Pow and e.exp.is_number and float(e.exp) < 0, fast)


def triton_source(expr: sp.Expr, lowp: bool = False) -> str:
    """The Triton source of ``expr`` (a sympy expression in x); ``lowp``: Φ as the 16-bit-data ``_phi``. Every
    constant subexpression becomes one float64 literal, inside the function symbols too (which evalf leaves alone):
    ``sqrt(2/pi)`` in GELU-tanh's σ(…) would otherwise run as float32 ``tl.sqrt`` and ``rsqrt`` calls, off by 5e-8
    in float64."""
    return TritonPrinter(lowp).doprint(_fold_constants(lower(expr).evalf(17)))


def _fold_constants(expr: sp.Expr) -> sp.Expr:
    return expr.replace(lambda e: e.is_number and not e.is_Number, lambda e: e.evalf(17))


def tanh_series(terms: int = 13) -> str:
    """Horner form of tanh's odd Taylor series z·Σ a_j z^{2j}, j < terms (relative error < 1e-17 at |z| = 0.3)."""
    z = sp.Symbol("z")
    poly = sp.Poly(sp.series(sp.tanh(z), z, 0, 2 * terms + 1).removeO() / z, z)
    return horner(tuple(float(poly.coeff_monomial(z ** (2 * j))) for j in range(terms)), "z2")


def horner(coeffs: tuple[float, ...], var: str) -> str:
    """c₀ + var·(c₁ + var·(…)) as Triton source, the coefficients printed by repr (exact float64)."""
    body = repr(coeffs[-1])
    for c in reversed(coeffs[:-1]):
        body = f"{c!r} + {var} * ({body})"
    return body


# ---- thresholds of 16-bit data, rounded to its grid -----------------------------------------------------------
def round_down(v: float, dtype: torch.dtype) -> float:
    """The largest value of ``dtype`` ≤ the float32 ``v`` (so x ≤ v ⇔ x ≤ result for every x of that dtype)."""
    t = torch.tensor(v, dtype=torch.float32)
    r = t.to(dtype)
    if r.float() > t:
        r = torch.nextafter(r, torch.tensor(float("-inf"), dtype=dtype))
    return float(r)


def round_up(v: float, dtype: torch.dtype) -> float:
    """The smallest value of ``dtype`` ≥ the float32 ``v`` (so x < v ⇔ x < result for every x of that dtype)."""
    return -round_down(-v, dtype)


def by_storage_dtype(dtype_expr: str, lines_for, indent: str) -> list[str]:
    """``if <dtype> == tl.bfloat16: … elif … tl.float16: … else: …`` (a compile-time branch), each body from
    ``lines_for(dtype)`` (None for fp32/fp64): what 16-bit data compares against, rounded to its dtype."""
    out = []
    for head, dtype in ((f"if {dtype_expr} == tl.bfloat16:", torch.bfloat16),
                        (f"elif {dtype_expr} == tl.float16:", torch.float16), ("else:", None)):
        out += [indent + head, *lines_for(dtype)]
    return out
