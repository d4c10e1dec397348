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


def moved(t, knots):
    """Table ``t`` with its knots moved by hand to ``knots``: the best levels for them, the loss recomputed (a
    consistent table, off the optimum)."""
    from approxbp.approximations.tables import from_json

    obj = ReluSumObjective(get_activation(t.expression), t.bits, t.objective, t.interval)
    d = t.to_json()
    d["knots"] = [float(c) for c in knots]
    d["levels"] = [float(v) for v in obj.levels_for(np.array(d["knots"]))]
    d["weights"] = [float(w) for w in np.diff(d["levels"])]
    d["loss"] = float(obj(np.array(d["knots"]))[0])
    d["metrics"].pop("certified", None)
    return from_json(d)
