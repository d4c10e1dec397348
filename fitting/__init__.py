"""Fitting: objectives, optimisers and reproduction of the papers' solutions.

Imports ``approximations``; never ``kernels`` (the CLI module is the one thin layer over both).
"""

from .consistency import check_consistency
from .invact import fit_invact
from .objective import ReluSumObjective, interval_for, quadrature
from .relu_sum import METHODS, ReluSumFit, certify, equidistributed_knots, fit_relu_sum

__all__ = ["ReluSumObjective", "interval_for", "quadrature", "METHODS", "certify", "equidistributed_knots",
           "fit_relu_sum", "ReluSumFit", "fit_invact", "check_consistency"]
