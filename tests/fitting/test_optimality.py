"""fitting/optimality.py: the rigorous enclosure of a ReLU-sum table's objective (eqs. 14, 63) against the table and
scipy's quadrature; global certificates: k = 1's one feasible point (and a table moved off it refused), k = 2's
branch and bound (box lower bounds below the objective at points of the box, a worse table refused)."""

import json
import math
from dataclasses import replace

import numpy as np
import pytest
from _k2_tables import RELU, k2
from approxbp.approximations import get_activation
from approxbp.approximations.tables import from_json, load
from approxbp.fitting.objective import ReluSumObjective
from approxbp.fitting.objectives_k2 import DerivativeObjectiveK2
from approxbp.fitting.optimality import certify_relu_sum_global, relu_sum_objective
from flint import arb


@pytest.mark.parametrize("name", ["gelu-k2-derivative", "silu-k2-primitive", "gelu_tanh-k3-derivative",
                                  "mish-k2-primitive", "mish-k3-derivative"])  # mish: log(1 + eˣ), off its cut
def test_relu_sum_objective_enclosure_matches_the_table_and_scipy(name):
    from scipy.integrate import quad

    t = load(RELU / f"{name}.json")
    enc = relu_sum_objective(t)
    assert abs(enc - t.loss).upper() <= 1e-12 * t.loss
    act = get_activation(t.expression)
    knots, levels = np.array(t.knots), np.array(t.levels)
    target = act.f if t.objective == "primitive" else act.df

    def approx(v):
        if t.objective == "derivative":
            return levels[np.searchsorted(knots, v)]
        return float(np.sum(np.diff(levels) * np.maximum(v - knots, 0)))

    breaks = [t.interval[0], *knots, t.interval[1]]
    ref = sum(quad(lambda v: (float(target(v)) - approx(v)) ** 2, a, b, epsabs=1e-15, epsrel=1e-13)[0]
              for a, b in zip(breaks[:-1], breaks[1:]))
    assert abs(float(enc.mid()) - ref) <= 1e-11 * ref


def test_k1_is_the_only_feasible_point():
    cert = certify_relu_sum_global(load(RELU / "gelu-k1-derivative.json"))
    assert cert.passed and cert.gap == 0.0

def test_a_k1_table_moved_off_its_one_feasible_point_is_refused():
    t = load(RELU / "gelu-k1-derivative.json")
    moved = certify_relu_sum_global(replace(t, knots=(0.25,)))
    assert not moved.passed and moved.gap == math.inf, moved


def test_k2_primitive_box_bounds_hold_at_points_and_a_worse_table_fails():
    t, J, obj, rng = k2("gelu", "primitive", 5)
    for _ in range(40):
        c = np.sort(rng.uniform(-4, 4, 3))
        w = 10 ** rng.uniform(-3, -1)
        lo = [arb(v - w * rng.uniform()) for v in c]
        hi = [a + w for a in lo]
        if not (hi[0] < lo[1] and hi[1] < lo[2]):
            continue
        low, _ = J.lower_bound(lo, hi)
        for _ in range(3):
            point = np.sort([float(a.mid()) + w * rng.uniform() for a in lo])
            assert obj(point)[0] >= low
    d = json.loads((RELU / "gelu-k2-primitive.json").read_text())
    d["knots"] = [-2.5, 0.0, 2.5]  # a worse point: J = 1.18e-2 > 9.51e-3 at the optimum
    d["levels"] = [float(v) for v in obj.levels_for(np.array(d["knots"]))]
    d["weights"] = list(np.diff(d["levels"]))
    d["loss"] = obj(np.array(d["knots"]))[0]
    d["metrics"].pop("certified", None)
    cert = certify_relu_sum_global(from_json(d), budget_s=math.inf, max_boxes=3000)  # found by 2000
    assert not cert.passed and "a better point exists" in cert.note


@pytest.mark.slow
def test_k2_branch_and_bound_lower_bound_holds_everywhere():
    t = load(RELU / "gelu-k2-derivative.json")
    cert = certify_relu_sum_global(t, budget_s=math.inf, max_boxes=5000)
    assert cert.lower <= cert.value and cert.gap >= 0
    obj = ReluSumObjective(get_activation("gelu"), 2, "derivative", t.interval)
    rng = np.random.default_rng(3)
    samples = [obj(np.sort(rng.uniform(*t.interval, 3)))[0] for _ in range(200)]
    samples += [obj(np.array(t.knots) + rng.normal(0, 1e-3, 3))[0] for _ in range(50)]
    assert min(samples) >= cert.lower
    J = DerivativeObjectiveK2(t)  # box lower bounds hold at points of the box
    for _ in range(50):
        lo = [arb(rng.uniform(-3, 0)), arb(rng.uniform(0, 1)), arb(rng.uniform(0, 1))]
        w = 10 ** rng.uniform(-4, -1)
        hi = [a + w for a in lo]
        low, _ = J.lower_bound(lo, hi)
        c1, d1, d2 = (float(a.mid()) + w * rng.uniform() for a in lo)
        assert obj(np.array([c1, c1 + d1, c1 + d1 + d2]))[0] >= low
