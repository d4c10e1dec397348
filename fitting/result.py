"""The one result type of every fit: a ``scipy.optimize.OptimizeResult`` that holds the typed table; and a
certificate's verdict (:class:`Verdict`)."""

from __future__ import annotations

import enum

from scipy.optimize import OptimizeResult

__all__ = ["FitResult", "Verdict"]


class FitResult(OptimizeResult):
    """What :func:`~approxbp.fitting.fit_relu_sum` and :func:`~approxbp.fitting.fit_invact` return: ``table`` (the
    typed, validated table: ``tables.save`` it, then ``approxbp export`` it), ``fun`` (its headline error: the
    objective J of eq. 13 for a ReLU sum, the worse branch's L∞ for InvAct), ``success``, ``message`` and ``seconds``
    (the fit itself). ``fit_relu_sum`` adds ``x`` (knots), ``nfev``, ``restarts``, ``restart_labels``, ``at_best`` and
    ``untrusted`` (:class:`~approxbp.fitting.ReluSumFit`)."""


class Verdict(enum.Enum):
    """A certificate's verdict: ``HELD`` (every claim proven), ``OPEN`` (nothing violated, but a bound or the
    optimality search did not close within its budget: more ``--budget`` or ``--max-boxes`` may close it) or
    ``FAILED`` (a claim is violated: a better point, an error above the claim, a loss outside its enclosure);
    ``UNCERTIFIABLE``: no certificate applies (a table fitted with a weight: the enclosures are of the uniform
    objective), which no budget closes. Truthy only when held; ``a & b`` is the worse of the two."""

    HELD = "held"
    OPEN = "open within budget"
    UNCERTIFIABLE = "not certifiable"
    FAILED = "failed"

    def __bool__(self) -> bool:
        return self is Verdict.HELD

    def __and__(self, other: Verdict) -> Verdict:
        order = (Verdict.HELD, Verdict.OPEN, Verdict.UNCERTIFIABLE, Verdict.FAILED)
        return max(self, other, key=order.index)

    @classmethod
    def of(cls, passed: bool, violated: bool) -> Verdict:
        """HELD when ``passed``, else FAILED when ``violated``, else OPEN."""
        return cls.HELD if passed else cls.FAILED if violated else cls.OPEN
