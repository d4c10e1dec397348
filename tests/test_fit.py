"""Fitting: determinism, reproduction of the paper's rows, certification, bad input."""

import numpy as np
import pytest
from approxbp.fitting import fit_relu_sum
from approxbp.fitting.reproduce import PAPER_RELU_SUM, paper_table, reproduce_relu_sum


@pytest.fixture(scope="module")
def rows():
    return reproduce_relu_sum(seed=0, restarts=4, workers=2, progress=False)


def test_ours_at_most_paper_for_every_row(rows):
    assert len(rows) == 3
    for r in rows:
        assert r.ours <= r.paper, r.label
        assert r.relative_gap >= 0


@pytest.mark.parametrize("i", range(3))
def test_fitted_coefficients_close_to_the_printed_ones(rows, i):
    paper, ours = PAPER_RELU_SUM[i], rows[i].ours_table
    # printed values (Approx-BP §4.2, App. E, App. I); ours are the exactly symmetric optimum nearby
    assert np.allclose(ours["weights"][:2], paper.a, atol=2e-3)
    assert np.allclose(ours["knots"], paper.c, atol=2e-2)
    assert ours["metrics"]["grad_inf_norm"] < 1e-8
    assert ours["metrics"]["hessian_min_eig"] > 0
    assert ours["constraint_residual"] <= 1e-12


def test_paper_losses_are_measured_independently():
    # the printed GELU solution, objective (46) on [-6.0697, 6.0697], evaluated by scipy quad in the objective tests;
    # here: the loss stored in the paper table is reproducible and positive
    t = paper_table(PAPER_RELU_SUM[0])
    assert 0.0095 < t["loss"] < 0.0096


def test_same_seed_same_numbers_regardless_of_workers():
    a = fit_relu_sum("silu", 3, "primitive", method="anneal", restarts=3, seed=7, workers=1, progress=False)
    b = fit_relu_sum("silu", 3, "primitive", method="anneal", restarts=3, seed=7, workers=2, progress=False)
    for f in ("weights", "knots", "levels", "loss"):
        assert a[f] == b[f]


def test_methods_agree_on_the_optimum():
    losses = [fit_relu_sum("gelu", 2, "derivative", method=m, restarts=2, seed=1, workers=1,
                           progress=False)["loss"] for m in ("anneal", "sgd", "polish")]
    assert max(losses) - min(losses) <= 1e-12 * max(losses)


def test_k1_is_relu():
    t = fit_relu_sum("gelu", 1, "primitive", progress=False)
    assert t["weights"] == [1.0] and t["knots"] == [0.0]


@pytest.mark.parametrize("kwargs,match", [
    ({"bits": 0}, "bits must be in 1..8"),
    ({"bits": 9}, "bits must be in 1..8"),
    ({"activation": "nonsense"}, "unknown activation"),
    ({"activation": "tanh"}, "cannot be approximated"),
    ({"objective": "l1"}, "objective must be one of"),
    ({"method": "bfgs"}, "method must be one of"),
    ({"restarts": 0}, "restarts must be a positive integer"),
    ({"seed": -1}, "seed must be a non-negative integer"),
])
def test_bad_input_is_refused(kwargs, match):
    args = {"activation": "gelu", "bits": 2, "progress": False, **kwargs}
    with pytest.raises(ValueError, match=match):
        fit_relu_sum(**args)
