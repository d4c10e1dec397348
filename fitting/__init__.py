"""Fitting: objectives, optimisers, symbolic regression, the fast InvAct fitter, the error atlas.

Imports ``approximations``; never ``kernels`` (the top layer, ``approxbp/``: CLI, reproduction, experiments, uses
both; tests/test_architecture.py holds the direction).
"""

from .consistency import check_consistency
from .invact import fit_invact
from .objective import ReluSumObjective, interval_for, quadrature
from .relu_sum import METHODS, ReluSumFit, certify, equidistributed_knots, fit_relu_sum
from .result import FitResult

__all__ = ["ReluSumObjective", "interval_for", "quadrature", "METHODS", "certify", "equidistributed_knots",
           "fit_relu_sum", "ReluSumFit", "FitResult", "fit_invact", "check_consistency"]
