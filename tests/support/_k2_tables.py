"""A packaged k = 2 ReLU-sum table with its closed-form objective and the fitter's, for the optimality tests."""

import numpy as np
from approxbp.approximations import get_activation
from approxbp.approximations.tables import data_dir, load
from approxbp.fitting.objective import ReluSumObjective
from approxbp.fitting.objectives_k2 import DerivativeObjectiveK2, PrimitiveObjectiveK2

RELU = data_dir() / "relu_sum"


def k2(activation: str, objective: str, seed: int):
    """(table, its closed-form J, the fitter's objective, a generator) for a packaged k = 2 table."""
    t = load(RELU / f"{activation}-k2-{objective}.json")
    J = (DerivativeObjectiveK2 if objective == "derivative" else PrimitiveObjectiveK2)(t)
    return t, J, ReluSumObjective(get_activation(activation), 2, objective, t.interval), np.random.default_rng(seed)
