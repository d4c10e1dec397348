"""The certifier's expression tape: run on the values alone (no derivative, no float32 error to carry) it gives the
very balls the Ball tape gives, each node's Arb operations in the same order."""

import sympy as sp
from approxbp.fitting import intervals as iv
from flint import arb

x, y = sp.symbols("x y")
EXPRESSIONS = (x * y + 3 * x**2 - y / (1 + x**2), sp.sqrt(x**2 + 1) ** 3 / (x - 7), sp.exp(-x) * sp.erf(y) - x**-3,
               sp.Max(x, y, 0) * sp.log(1 + sp.exp(y)) + sp.pi * x / 3, (x + y) ** (sp.Rational(-1, 2)) + sp.tanh(x),
               x / 3 + y / 7 + x * y / 11 + sp.pi * y**2 / 13 + sp.E)  # terms whose order of rounding shows


def test_the_values_only_tape_gives_the_ball_tapes_balls():
    env = {x: iv.Ball(iv.box(arb("0.3"), arb("0.31"))), y: iv.Ball(arb("1.7", 1e-9))}
    plain = iv.Evaluator().many(EXPRESSIONS, env)
    seeded = iv.Evaluator().many(EXPRESSIONS, {**env, x: iv.Ball(env[x].v, arb(1))})  # a derivative: the Ball tape
    assert all(p.d is None for p in plain) and any(s.d is not None for s in seeded)
    for p, s in zip(plain, seeded):
        assert p.v.mid() == s.v.mid() and p.v.rad() == s.v.rad() and p.v.is_finite(), (p.v, s.v)
    one = iv.Evaluator()(EXPRESSIONS[-1], env).v  # a single expression takes the same tape
    assert one.mid() == plain[-1].v.mid() and one.rad() == plain[-1].v.rad()
