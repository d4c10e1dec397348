"""Fitting: objectives, optimisers, symbolic regression, the fast InvAct fitter, the error atlas.

Imports ``approximations``; never ``kernels`` (the top layer, ``approxbp/``: CLI, reproduction, experiments, uses
both; tests/test_architecture.py holds the direction).
"""

from .consistency import check_consistency
from .invact import fit_invact
from .objective import ReluSumObjective, interval_for, quadrature
from .relu_sum import METHODS, ReluSumFit, equidistributed_knots, fit_relu_sum, local_certificate
from .result import FitResult

__all__ = ["ReluSumObjective", "interval_for", "quadrature", "METHODS", "local_certificate", "equidistributed_knots",
           "fit_relu_sum", "ReluSumFit", "FitResult", "fit_invact", "check_consistency"]


def __getattr__(name):
    """``approxbp.fitting.certify`` is always the module ``fitting/certify.py`` (the rigorous certificates), before
    and after it is imported (0.1's function of that name is :func:`local_certificate`)."""
    if name == "certify":
        import importlib

        return importlib.import_module(f"{__name__}.certify")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
