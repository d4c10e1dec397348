"""Arb ball helpers (python-flint), one set for the function set's ball forms (:mod:`.backends`) and the rigorous
evaluator (``fitting.intervals``): a box from its endpoints, monotone functions by their endpoints, tight integer
powers of balls that hold 0, and a working precision scoped as mpmath's ``workdps`` is. Complex balls (Arb's
integration) pass through each helper evaluated directly. flint is imported when a helper first runs, so that the
kernels' run time, which imports :mod:`.backends` for its torch forms, never loads it."""

from __future__ import annotations

import contextlib
import functools

__all__ = ["arb_type", "at_precision", "box", "ipow", "monotone", "precision", "square"]


@functools.cache
def arb_type():
    """flint's real ball type, imported on the first call, for every ball helper here and in :mod:`.backends` (a
    ``from flint import`` in each cost the certifiers ~2 M imports per table)."""
    from flint import arb

    return arb


def box(lo, hi):
    """The ball holding [lo, hi] (lo, hi exact)."""
    arb = arb_type()
    return arb(lo).union(arb(hi))


def monotone(fn, z, increasing: bool = True):
    """fn on a real ball by its endpoints (fn monotone): ball arithmetic alone turns exp on [0.75, 33] into a ball
    that contains negative numbers."""
    if not isinstance(z, arb_type()) or z.is_exact() or not z.is_finite():
        return fn(z)
    a, b = fn(z.lower()), fn(z.upper())
    return box(a.lower(), b.upper()) if increasing else box(b.lower(), a.upper())


def ipow(v, n: int):
    """vⁿ for an integer n, tight for a ball holding 0 (by its endpoints; an even n gives a ball ≥ 0)."""
    arb = arb_type()
    if not isinstance(v, arb):
        return v**n
    if n == 0:
        return arb(1)
    if n < 0:
        return 1 / ipow(v, -n)
    lo, hi = v.lower() ** n, v.upper() ** n
    if v.lower() >= 0 or v.upper() <= 0:
        return box(lo, hi)
    return box(0, max(lo, hi)).nonnegative_part() if n % 2 == 0 else box(lo, hi)


def square(z):
    """z² (:func:`ipow`)."""
    return ipow(z, 2)


@contextlib.contextmanager
def precision(bits: int):
    """Within: Arb's working precision is ``bits``; the caller's is restored on leaving."""
    from flint import ctx

    old = ctx.prec
    ctx.prec = bits
    try:
        yield
    finally:
        ctx.prec = old


def at_precision(bits: int):
    """A decorator: the function runs at :func:`precision` ``bits``."""
    def wrap(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            with precision(bits):
                return fn(*args, **kwargs)
        return run
    return wrap
