"""The one result type of every fit: a ``scipy.optimize.OptimizeResult`` that holds the typed table."""

from __future__ import annotations

from scipy.optimize import OptimizeResult

__all__ = ["FitResult"]


class FitResult(OptimizeResult):
    """What :func:`~approxbp.fitting.fit_relu_sum` and :func:`~approxbp.fitting.fit_invact` return: ``table`` (the
    typed, validated table: ``tables.save`` it, then ``approxbp export`` it), ``fun`` (its headline error: the
    objective J of eq. 13 for a ReLU sum, the worse branch's L∞ for InvAct), ``success``, ``message`` and ``seconds``
    (the fit itself). ``fit_relu_sum`` adds ``x`` (knots), ``nfev``, ``restarts``, ``restart_labels``, ``at_best`` and
    ``untrusted`` (:class:`~approxbp.fitting.ReluSumFit`)."""
