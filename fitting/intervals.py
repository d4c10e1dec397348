"""Rigorous evaluation of the project's sympy expressions in ball arithmetic (Arb, through python-flint).

:class:`Evaluator` compiles an expression once and returns, for a box X of its variable, a :class:`Ball`: an enclosure
of the value over X, of the derivative over X (None where a ``select`` may jump inside X), and optionally of the
float32 rounding error of a kernel that evaluates the same expression operation by operation
(:data:`FP32_ULPS`). Nothing is sampled: every enclosure contains every value the real function takes on X.

* Max, Min, Abs, select, Heaviside decide their branch when the balls allow it and take the union of both
  otherwise.
* The value on a box is tightened by the mean-value form f(X) ⊂ f(m) + f′(X)·(X − m) (:func:`enclosure`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import sympy as sp
from approxbp.approximations import backends, balls
from flint import arb

__all__ = ["at_precision", "Ball", "box", "complex_function", "enclosure", "Evaluator", "float32", "kept", "lower",
           "nonnegative_sum", "number", "PRECISION", "precision", "proven_lower", "U32", "upper"]


#: Working precision (bits) of every ball: boxes near an InvAct turning point are 1e-30 wide.
PRECISION = 160
#: float32's unit roundoff.
U32 = 2.0**-24
#: Errors of the float32 operations a generated kernel runs, in ulps (1 ulp ≤ 2u·|result|): IEEE add, sub, mul
#: (0.5; a contracted FMA rounds once, within the bound for two roundings); Triton's ``/`` (div.full.f32, 2 ulp,
#: PTX ISA) and the kernels' ``_rcp`` times a product (1 + ½ ulp) share "div". The functions' errors are in the
#: function set (``approximations.backends``, field ``fp32_ulps``).
_OPERATION_ULPS = {"add": 0.5, "mul": 0.5, "div": 2.0}


def __getattr__(name):  # FP32_ULPS: the operations' and the function set's, read when asked
    if name == "FP32_ULPS":
        return {**_OPERATION_ULPS, **backends.fp32_ulps()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: A decorator: the function runs at :data:`PRECISION` bits (the caller's precision restored after).
at_precision = balls.at_precision(PRECISION)


def precision():
    """Within: Arb's working precision is :data:`PRECISION` bits; the caller's is restored on leaving."""
    return balls.precision(PRECISION)


def number(v) -> arb:
    """An exact ball for a Python or sympy number (rationals exactly; floats are dyadic, so exact too)."""
    if isinstance(v, sp.Rational | sp.Float):
        r = sp.Rational(v)
        return arb(int(r.p)) / arb(int(r.q)) if r.q != 1 else arb(int(r.p))
    return arb(v)


def float32(v) -> arb:
    """The float32 nearest to a number, exactly (what a Triton literal becomes beside float32 tensors)."""
    return arb(float(np.float32(float(v))))


box = balls.box

def upper(b: arb) -> float:
    """An upper bound of |b| as a float (rounded up); inf for NaN balls."""
    if not b.is_finite():
        return math.inf
    v = float(b.abs_upper())
    return math.nextafter(v, math.inf) if v else 0.0


def proven_lower(b: arb) -> float:
    """The lower end of ``b`` as a float (rounded down) where ``b`` is finite, else −∞: a NaN or infinite ball
    proves no lower bound, and a branch and bound must keep (split) a box bounded by it, never compare it away."""
    if not b.is_finite():
        return -math.inf
    return math.nextafter(float(b.lower()), -math.inf)  # float() rounds to nearest: one step down (−0.0 too)


def kept(low: float) -> float:
    """A box's lower bound as a branch and bound may compare it: a finite float as it is, anything else (NaN, ±∞
    from an overflowed enclosure) −∞. ``nan <= cutoff`` is False: compared raw, a NaN bound discards its box."""
    return low if math.isfinite(low) else -math.inf


def nonnegative_sum(terms: list[arb]) -> float:
    """A lower bound of a sum of terms each ≥ 0 from enclosures of them: each term counts for max(its lower end,
    0), and one that is not finite (NaN, an overflow) for 0 — still a bound, where the raw sum would be NaN."""
    total = arb(0)
    for term in terms:
        if term.is_finite():
            total += arb(max(term.lower(), 0))
    v = float(total.lower())
    return math.nextafter(v, 0.0) if v else 0.0


def lower(b: arb) -> float:
    """A lower bound of |b| as a float (rounded down)."""
    if not b.is_finite():
        return 0.0
    v = float(b.abs_lower())
    return math.nextafter(v, 0.0) if v else 0.0


@dataclass
class Ball:
    """Value enclosure ``v``, derivative enclosure ``d`` (None: unknown or discontinuous), float32 error bound ``e``
    (an upper bound of |computed − exact|, as a ball ≥ 0; None when not tracked)."""

    v: arb
    d: arb | None = None
    e: arb | None = None


def _nonneg(b: arb) -> arb:
    """A ball known to be ≥ 0 whose representation dips below 0 by rounding only (``box`` of a Max); a complex ball
    (Arb's integration, whose integrand checks its branch cuts itself) as it is."""
    if not isinstance(b, arb):
        return b
    lo = b.lower()
    if lo < 0 and -lo <= arb(2) ** -(PRECISION - 40) * (1 + abs(b.upper())):
        return b.nonnegative_part()
    return b


def _extreme(args: list[Ball], largest: bool) -> Ball:
    """Max/Min: a decided argument, else the interval [max lower, max upper] (derivative: the union, valid for
    the mean-value form since max is Lipschitz and piecewise one of its arguments)."""
    key = (lambda b: b.v.lower()) if largest else (lambda b: -b.v.upper())
    best = max(args, key=key)
    if all(best is b or (best.v >= b.v if largest else best.v <= b.v) for b in args):
        return best
    los = [b.v.lower() for b in args]
    his = [b.v.upper() for b in args]
    lo, hi = (max(los), max(his)) if largest else (min(los), min(his))
    v = box(lo, hi)
    v = _nonneg(v) if lo >= 0 else v
    d = None if any(b.d is None for b in args) else _union(*(b.d for b in args))
    e = None if any(b.e is None for b in args) else _max(*(b.e for b in args))
    return Ball(v, d, e)


def _union(*balls: arb) -> arb:
    out = balls[0]
    for b in balls[1:]:
        out = out.union(b)
    return out


def _max(*balls: arb) -> arb:
    return arb(max(b.upper() for b in balls))


def _rounding(ulps: float, magnitude: arb) -> arb:
    """The rounding error bound ulps·2u·|value| (an ulp is at most 2u relative to the result)."""
    return arb(ulps * 2 * U32) * arb(magnitude.abs_upper())


class Evaluator:
    """Evaluate sympy expressions on balls. ``calls`` maps names of undefined functions (q_left, …) to Python
    callables on Balls; ``constant`` maps a number node to its ball (exact, or rounded to float32 as a kernel
    writes it); ``fp32`` tracks the float32 running error bound."""

    def __init__(self, calls=None, constant=number, fp32: bool = False, log_error: tuple[float, float] = (0.0, 0.0)):
        self.calls = dict(calls or {})
        self.constant = constant
        self.fp32 = fp32
        self.log_error = tuple(arb(v) for v in log_error)  # |log error| ≤ A + B·|log v|
        self.forms, self.ulps = backends.arb_forms(), backends.fp32_ulps()  # the function set, read once
        self._tapes: dict = {}

    def __call__(self, expr: sp.Expr, env: dict[sp.Symbol, Ball]) -> Ball:
        """The value (and derivative, error) of ``expr`` with its symbols bound by ``env``; arb or acb balls."""
        return self.many((expr,), env)[0]

    def many(self, exprs: tuple[sp.Expr, ...], env: dict[sp.Symbol, Ball]) -> list[Ball]:
        """Several expressions on one tape: subexpressions they share (a gradient's and a Hessian's) run once.
        Without a derivative or a float32 error to carry (no ``d`` in ``env``, not ``fp32``) the tape runs on the
        values alone (:meth:`_value_step`): the same Arb operations in the same order, without a Ball per node."""
        plain = not self.fp32 and all(b.d is None for b in env.values())
        key = ("values" if plain else "balls", exprs)
        tape = self._tapes.get(key)
        if tape is None:
            tape = self._tapes[key] = self._compile(*exprs, plain=plain)
        vals: list = []
        given = {s: b.v for s, b in env.items()} if plain else env
        for step in tape[0]:
            vals.append(step(vals, given))
        return [Ball(vals[i]) for i in tape[1]] if plain else [vals[i] for i in tape[1]]

    # ---- compiling expressions into a tape: one step per distinct node, in dependency order ---------
    def _compile(self, *exprs: sp.Expr, plain: bool = False):
        index: dict = {}
        tape: list = []
        make = self._value_step if plain else self._step

        def node(e) -> int:
            if e not in index:
                step = make(e, node)  # its arguments first
                tape.append(step)
                index[e] = len(tape) - 1
            return index[e]

        outputs = [node(e) for e in exprs]
        return tape, outputs

    def _value_step(self, e, node):
        """The step computing node ``e``'s value (an arb) from its arguments' values: sums, products, quotients
        and integer powers directly, as :meth:`_add`, :meth:`_mul`, :meth:`_div` and :meth:`_ipow_ball` compute
        their ``v``; any other node through its Ball step (:meth:`_step`) on Balls of the values."""
        if e.is_Symbol:  # the value ``env`` binds it to: here an arb
            return self._step(e, node)
        if e.is_Number or e in (sp.pi, sp.E):
            v = self._step(e, node)(None, None).v
            return lambda vals, env: v
        if isinstance(e, sp.Mul):
            num = [node(a) for a in e.args if not _is_reciprocal(a)]
            den = [node(a.base) for a in e.args if _is_reciprocal(a)]

            # the Ball step's order (the factors folded left, then each division), as loops: _fold on a new list
            # per node made the values-only tape a quarter slower (a 30-box comparison 35.4 → 44.6 s)
            def product(vals, env):
                out = vals[num[0]] if num else arb(1)
                for i in num[1:]:
                    out = out * vals[i]
                for i in den:
                    out = out / vals[i]
                return out
            return product
        if isinstance(e, sp.Add):
            args = [node(a) for a in e.args]

            def total(vals, env):
                out = vals[args[0]]
                for i in args[1:]:
                    out = out + vals[i]
                return out
            return total
        if isinstance(e, sp.Pow) and e.exp.is_Integer:
            i, k = node(e.base), int(e.exp)
            if k == -1:
                return lambda vals, env: arb(1) / vals[i]
            if k > 0:
                return lambda vals, env: balls.ipow(vals[i], k)
            return lambda vals, env: arb(1) / balls.ipow(vals[i], -k)
        step = self._step(e, node)
        return lambda vals, env: step(_Balls(vals), env).v

    def _step(self, e, node):
        """The step computing node ``e`` from the values of its arguments (compiled first, through ``node``)."""
        if e.is_Symbol:
            def symbol(vals, env, e=e):
                if e not in env:
                    raise ValueError(f"no value for symbol {e}")
                return env[e]
            return symbol
        if e.is_Number or e in (sp.pi, sp.E):
            v = self.constant(e) if e.is_Number else (arb.pi() if e == sp.pi else arb(1).exp())
            ball = Ball(v, arb(0), self._zero_error())
            return lambda vals, env: ball
        if isinstance(e, sp.Pow):
            return self._pow_step(e, node)
        if isinstance(e, sp.Mul):
            num = [node(a) for a in e.args if not _is_reciprocal(a)]
            den = [node(a.base) for a in e.args if _is_reciprocal(a)]
            one = Ball(arb(1), arb(0), self._zero_error())

            def product(vals, env):  # factors b**-1 become one division (what the GPU rounds once)
                out = self._fold([vals[i] for i in num], self._mul) if num else one
                for i in den:
                    out = self._div(out, vals[i])
                return out
            return product
        args = [node(a) for a in e.args]
        if isinstance(e, sp.Add):
            return lambda vals, env: self._fold([vals[i] for i in args], self._add)
        name = type(e).__name__
        if name in ("Max", "Min"):
            return lambda vals, env: _extreme([vals[i] for i in args], name == "Max")
        if name == "Abs":
            return lambda vals, env: _extreme([vals[args[0]], self._neg(vals[args[0]])], True)
        if name == "select":
            return lambda vals, env: self._select(*(vals[i] for i in args))
        if name == "Heaviside":  # the unit step (½ at 0): decided like select(u, 1, 0), the union [0, 1] across 0
            return lambda vals, env: self._select(vals[args[0]], *(Ball(arb(c), arb(0), self._zero_error())
                                                                   for c in (1, 0)))
        if name in self.calls:
            fn = self.calls[name]
            return lambda vals, env: fn(*(vals[i] for i in args))
        if name not in self.forms:
            raise ValueError(f"function {name!r} is not supported by the certifier")
        return lambda vals, env: self._unary(name, vals[args[0]])

    def _zero_error(self):
        return arb(0) if self.fp32 else None

    def _fold(self, args, op):
        out = args[0]
        for a in args[1:]:
            out = op(out, a)
        return out

    def _add(self, a: Ball, b: Ball) -> Ball:
        v = a.v + b.v
        d = None if a.d is None or b.d is None else a.d + b.d
        e = None
        if self.fp32:
            spread = a.e + b.e
            e = spread + _rounding(_OPERATION_ULPS["add"], abs(v) + spread)
        return Ball(v, d, e)

    def _neg(self, a: Ball) -> Ball:
        return Ball(-a.v, None if a.d is None else -a.d, a.e)

    def _mul(self, a: Ball, b: Ball) -> Ball:
        v = a.v * b.v
        d = None if a.d is None or b.d is None else a.d * b.v + a.v * b.d
        e = None
        if self.fp32:
            exact_scale = a.v.is_exact() and _is_pow2(a.v) or b.v.is_exact() and _is_pow2(b.v)
            if a.e.is_zero() and b.e.is_zero() and exact_scale:
                return Ball(v, d, arb(0))  # multiplying by ±2^k (a sign flip) is exact
            spread = arb(abs(a.v).upper()) * b.e + arb(abs(b.v).upper()) * a.e + a.e * b.e
            e = spread + _rounding(_OPERATION_ULPS["mul"], abs(v) + spread)
        return Ball(v, d, e)

    def _div(self, a: Ball, b: Ball) -> Ball:
        v = a.v / b.v
        d = None if a.d is None or b.d is None else (a.d * b.v - a.v * b.d) / (b.v * b.v)
        e = None
        if self.fp32:
            lo = arb(abs(b.v).lower()) - b.e  # |computed denominator| ≥ |b| − e_b
            spread = (a.e + arb(abs(v).upper()) * b.e) / lo if lo > 0 else arb("inf")
            e = spread + _rounding(_OPERATION_ULPS["div"], abs(v) + spread)
        return Ball(v, d, e)

    def _pow_step(self, e, node):
        i, n = node(e.base), e.exp
        one = Ball(arb(1), arb(0), self._zero_error())
        if n == -1:
            return lambda vals, env: self._div(one, vals[i])
        if n.is_Integer:
            k = abs(int(n))
            if self.fp32:
                power = lambda vals: self._fold([vals[i]] * k, self._mul)  # noqa: E731
            else:
                power = lambda vals: self._ipow_ball(vals[i], k)  # noqa: E731
            return (lambda vals, env: power(vals)) if n > 0 else (lambda vals, env: self._div(one, power(vals)))
        if n.is_Rational and n.q == 2:  # b^(p/2) = sqrt(b)^p
            p = int(n.p)

            def half(vals, env):
                root = self._unary("sqrt", vals[i])
                power = self._fold([root] * abs(p), self._mul)
                return power if p > 0 else self._div(one, power)
            return half
        raise ValueError(f"power {e} is not supported by the certifier (integer and half-integer exponents only)")

    def _ipow_ball(self, a: Ball, n: int) -> Ball:
        v = balls.ipow(a.v, n)
        d = None if a.d is None else arb(n) * balls.ipow(a.v, n - 1) * a.d
        return Ball(v, d, None)

    def _select(self, c: Ball, a: Ball, b: Ball) -> Ball:
        """select(c, a, b) = a where c > 0 else b. Undecided: the union of both, no derivative; in float32 the
        computed c may fall on the other side, so the error also covers the jump |a − b|."""
        margin = c.e if self.fp32 else arb(0)
        if c.v.lower() > margin:
            return a
        if c.v.upper() <= -margin:
            return b
        v = a.v.union(b.v)
        e = None
        if self.fp32:
            e = _max(a.e, b.e) + arb(abs(a.v - b.v).upper())
        return Ball(v, None, e)

    # ---- elementary functions --------------------------------------------------------------------
    def _unary(self, name: str, a: Ball) -> Ball:
        f, df = self.forms[name]
        x = _nonneg(a.v) if name in ("sqrt", "log") else a.v
        v = f(x)
        d = None if a.d is None else df(x) * a.d
        e = None
        if self.fp32:
            wide = _nonneg(x + arb(0, a.e.upper())) if name in ("sqrt", "log") else x + arb(0, a.e.upper())
            spread = arb(abs(df(wide)).upper()) * a.e  # mean-value bound of the propagated input error
            if name == "sqrt":  # |√(v + e) − √v| ≤ √e also holds where √'s slope is unbounded (v → 0)
                spread = arb(min(spread.upper(), a.e.sqrt().upper())) if spread.is_finite() else a.e.sqrt()
            if name == "log":
                e = spread + self.log_error[0] + self.log_error[1] * arb(abs(f(wide)).upper())
            else:
                e = spread + _rounding(self.ulps[name], abs(f(wide)))
            if name == "exp":  # tl.exp computes 2^(x·log2 e): the rounded product scales the error by |x|
                e += arb(abs(v).upper()) * arb(abs(x).upper()) * arb(2 * U32)
        return Ball(v, d, e)


class _Balls:
    """A values-only tape's values seen as Balls without a derivative or an error (what :meth:`Evaluator._step`'s
    steps read)."""

    def __init__(self, values: list):
        self.values = values

    def __getitem__(self, i: int) -> Ball:
        return Ball(self.values[i])


def _is_pow2(v: arb) -> bool:
    m = abs(float(v.mid()))
    return m > 0 and math.frexp(m)[0] == 0.5


def _is_reciprocal(a) -> bool:
    return isinstance(a, sp.Pow) and a.exp == -1


def enclosure(point: Ball, over: Ball, x_box: arb, x_mid: arb) -> arb:
    """The value on a box: the direct enclosure ``over.v`` intersected with the mean-value form
    f(m) + f′(X)·(X − m) where the derivative is known."""
    v = over.v
    if over.d is not None and over.d.is_finite() and point.v.is_finite():
        mv = point.v + over.d * (x_box - x_mid)
        if not v.is_finite():
            return mv
        try:
            return v.intersection(mv)
        except ValueError:  # disjoint can only mean an evaluation bug
            raise ArithmeticError("the direct and mean-value enclosures are disjoint") from None
    return v


# ---- Arb's integration: an expression as a function of a complex ball -------------------------------------------
#: What must stay off the cut (−∞, 0] for a branch-cut function of u to be holomorphic: its argument's real part > 0.
_CUT_ARGUMENT = {"log": lambda u: u, "sqrt": lambda u: u, "softplus": lambda u: 1 + sp.exp(u), "log1p": lambda u: 1 + u}


def complex_function(expr: sp.Expr, var: sp.Symbol):
    """(z, analytic) ↦ expr(z) on complex balls (acb), for Arb's rigorous integration: the same
    :class:`~.intervals.Evaluator`. Where Arb asks for holomorphy (``analytic``), every log, square root, softplus,
    log1p and non-integer power must have its argument's real part certainly > 0 on the ball (off the cut
    (−∞, 0]); where that is not proven the value is NaN and Arb subdivides. log(1 + eᶻ) is holomorphic in
    |Im z| < π/2, so softplus and Mish integrate. Kinks (abs, max, Heaviside, …) are refused."""
    from flint import acb

    guards = []
    for e in sp.preorder_traversal(expr):
        if not e.free_symbols:
            continue
        name = type(e).__name__
        if name in backends.rough_functions() or (name in backends.branch_cuts() and name not in _CUT_ARGUMENT):
            raise ValueError(f"the certifier cannot integrate {e} rigorously (a branch cut or a kink)")
        if isinstance(e, sp.Pow) and not e.exp.is_Integer:
            guards.append(e.base)
        elif name in _CUT_ARGUMENT:
            guards.append(_CUT_ARGUMENT[name](e.args[0]))
    ev = Evaluator()

    def f(z, analytic: bool = False):
        if analytic and not all(ev(g, {var: Ball(z)}).v.real > 0 for g in guards):
            return acb(arb.nan())
        return ev(expr, {var: Ball(z)}).v
    return f
