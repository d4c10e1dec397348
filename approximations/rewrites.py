"""The stable form of an expression (one home for the rewrites every evaluator and code generator applies first):
sums and powers that cancel or overflow in floating point, written as the functions that do not."""

from __future__ import annotations

import sympy as sp

from .functions import expm1 as _functions_expm1
from .functions import sigmoid, softplus

__all__ = ["stable_form"]


_softplus = softplus  # log(1 + e^u), written back by stable_form
_expm1 = _functions_expm1  # e^u − 1, likewise


def stable_form(expr: sp.Expr) -> sp.Expr:
    """Rewrites every evaluator uses to avoid cancellation and overflow in user expressions:
    log(1 + exp(u)) → softplus(u), c·eᵘ − c → c·expm1(u) (c > 0: ELU's eˣ − 1 keeps its relative accuracy near 0),
    (1 + exp(u))⁻ⁿ → σ(−u)ⁿ, e^(a+u)·σ(−u)ⁿ → e^a·σ(u)·σ(−u)ⁿ⁻¹, 1 − 2σ(v) →
    −tanh(v/2), 1 + tanh(u) → 2σ(2u)
    (so the derivative of x·(1 − 2/(e^(2eˣ) + 1)) holds no e^(2eˣ))."""
    expr = _rewrite(expr, _log_one_plus_exp)
    for rule in (_sigmoid_power, _merge_exp_sigmoid, _one_minus_two_sigmoid, _exp_minus_one):
        expr = _rewrite(expr, rule)
    return _rewrite(expr, _one_plus_tanh)


def _one_plus(e: sp.Expr, head) -> sp.Expr | None:
    """u where e is exactly 1 + head(u) (the 1 may be a Float), else None. A structural test: sympy's pattern
    matching of the same sum (a Wild inside an Add) costs most of a table's validation."""
    if not (e.is_Add and len(e.args) == 2):
        return None
    one, other = sorted(e.args, key=lambda a: not a.is_Number)
    return other.args[0] if one.is_Number and float(one) == 1.0 and isinstance(other, head) else None


def _log_one_plus_exp(e: sp.Expr):
    """log(1 + eᵘ) = softplus(u), or None."""
    u = _one_plus(e.args[0], sp.exp) if isinstance(e, sp.log) else None
    return None if u is None else _softplus(u)


def _one_plus_tanh(e: sp.Expr):
    """1 + tanh(u) = 2σ(2u), or None."""
    u = _one_plus(e, sp.tanh)
    return None if u is None else 2 * sigmoid(2 * u)


def _rewrite(expr: sp.Expr, rule) -> sp.Expr:
    """``expr`` with each subexpression e for which ``rule(e)`` is not None replaced by it (bottom-up, each rule
    applied once per node)."""
    found: dict = {}

    def query(e) -> bool:
        new = rule(e)
        if new is not None:
            found[e] = new
        return new is not None
    return expr.replace(query, lambda e: found[e])


def _sigmoid_power(e: sp.Expr):
    """(1 + eᵘ)⁻ⁿ = σ(−u)ⁿ, or None."""
    n = _whole(e.exp) if e.is_Pow else None
    u = _exp_of_one_plus(e.base) if n is not None and n < 0 else None
    return None if u is None else sigmoid(-u) ** -n


def _one_minus_two_sigmoid(e: sp.Expr):
    """The sum with its terms 1 and −2σ(v) replaced by −tanh(v/2) (no cancellation where σ(v) → ½), or None."""
    one = next((a for a in e.args if a.is_Number and float(a) == 1.0), None) if e.is_Add else None
    if one is None:
        return None
    for term in e.args:
        if (term.is_Mul and len(term.args) == 2 and term.args[0].is_Number and float(term.args[0]) == -2.0
                and isinstance(term.args[1], sigmoid)):
            rest = [t for t in e.args if t is not term and t is not one]
            return sp.Add(*rest, -sp.tanh(term.args[1].args[0] / 2))
    return None


def _exp_minus_one(e: sp.Expr):
    """The sum with its terms c·eᵘ and −c (c > 0 a number) replaced by c·expm1(u), or None."""
    if not e.is_Add:
        return None
    numbers = [a for a in e.args if a.is_Number]
    for term in e.args:
        c, rest = term.as_coeff_Mul()
        if isinstance(rest, sp.exp) and c.is_positive and (minus := next((n for n in numbers if n == -c), None)):
            others = [a for a in e.args if a is not term and a is not minus]
            return sp.Add(*others, c * _expm1(rest.args[0]))
    return None


def _whole(n: sp.Expr) -> int | None:
    """n as an int when it is a whole number (2 or 2.0), else None."""
    return int(n) if n.is_number and n.is_real and float(n).is_integer() else None


def _exp_of_one_plus(e: sp.Expr):
    """u when e is 1 + exp(u) (or 1.0 + exp(u)), else None."""
    if e.is_Add and len(e.args) == 2:
        one, other = sorted(e.args, key=lambda a: not a.is_Number)
        if one.is_Number and float(one) == 1.0 and isinstance(other, sp.exp):
            return other.args[0]
    return None


def _sigmoid_factor(f: sp.Expr):
    """(σ(v), n) for a factor σ(v)ⁿ (n a positive integer, n = 1 for σ(v) itself), else None."""
    if isinstance(f, sigmoid):
        return f, 1
    if f.is_Pow and isinstance(f.base, sigmoid) and (n := _whole(f.exp)) is not None and n > 0:
        return f.base, n
    return None


def _exp_sigmoid_pair(m: sp.Mul):
    """(e^(a+ju), σ(−u)ⁿ factor, σ(−u), n, j, a) for a factor pair of the product m (1 ≤ j ≤ n), if there is one."""
    exps = [f for f in m.args if isinstance(f, sp.exp)]
    for f in m.args:
        if (found := _sigmoid_factor(f)) is None:
            continue
        s, n = found
        u = -s.args[0]
        for e in exps:
            for term in (e.args[0].args if e.args[0].is_Add else (e.args[0],)):
                j = term / u  # j·u / u cancels by itself; nothing else is an integer
                if j.is_Integer and 1 <= j <= n:
                    return e, f, s, n, int(j), e.args[0] - term
    return None


def _merge_exp_sigmoid(m: sp.Expr):
    """e^(a+ju)·σ(−u)ⁿ = e^a·σ(u)ʲ·σ(−u)ⁿ⁻ʲ, or None."""
    pair = _exp_sigmoid_pair(m) if m.is_Mul else None
    if pair is None:
        return None
    e, f, s, n, j, a = pair
    rest = [g for g in m.args if g is not e and g is not f]
    return sp.Mul(*rest, sp.exp(a), sigmoid(-s.args[0]) ** j, s ** (n - j))
