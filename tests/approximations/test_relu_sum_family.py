import numpy as np
import pytest
from approxbp.approximations import ReLUSum, get_activation
from approxbp.fitting import ReluSumObjective, interval_for
from hypothesis import given
from hypothesis import strategies as st

knots_strategy = st.integers(2, 5).flatmap(
    lambda k: st.lists(st.floats(-5.5, 5.5), min_size=2**k - 1, max_size=2**k - 1, unique=True)
    .map(lambda c: (k, np.sort(np.array(c))))
    .filter(lambda kc: np.min(np.diff(kc[1])) > 1e-3)
)


@pytest.mark.parametrize("objective", ["primitive", "derivative"])
@given(kc=knots_strategy)
def test_every_solution_satisfies_the_constraints_exactly(gelu, objective, kc):
    k, c = kc
    obj = ReluSumObjective(gelu, k, objective, interval_for(gelu, objective)[:2])
    rs = obj.solution(c)
    assert rs.constraint_residual <= 1e-12
    assert rs.levels[0] == 0.0 and abs(rs.levels[-1] - 1.0) <= 1e-12
    # h̃ = 0 left of c_1 and h̃ = x right of c_n (what Σw=1, Σw·c=0 mean)
    assert rs(np.array([c[0] - 1.0]))[0] == 0.0
    far = c[-1] + 2.0
    assert abs(rs(np.array([far]))[0] - far) <= 1e-11


@given(kc=knots_strategy, data=st.data())
def test_derivative_levels_match_finite_differences(kc, data):
    k, c = kc
    w = np.array(data.draw(st.lists(st.floats(-2, 2), min_size=c.size, max_size=c.size)))
    rs = ReLUSum(w, c)
    # midpoints of each segment (never on a knot)
    mids = np.concatenate([[c[0] - 1], (c[1:] + c[:-1]) / 2, [c[-1] + 1]])
    h = 1e-6 * np.min(np.diff(c))
    fd = (rs(mids + h) - rs(mids - h)) / (2 * h)
    assert np.allclose(rs.derivative(mids), fd, atol=1e-6)
    assert np.array_equal(rs.codes(mids), np.arange(2**k))
    assert np.allclose(rs.levels, np.concatenate([[0], np.cumsum(w)]))


def test_codes_are_left_continuous_like_torch_relu():
    rs = ReLUSum([1.0], [0.0])
    assert rs.codes(np.array([-1.0, 0.0, 1e-300])).tolist() == [0, 0, 1]
    assert rs.derivative(np.array([0.0]))[0] == 0.0


@pytest.mark.parametrize("w,c,match", [
    ([1.0, 0.0], [0.0, 1.0], "2\\^k − 1"),
    ([np.nan, 1, 0], [0, 1, 2], "finite"),
    ([0.5, 0.5, 0.0], [1.0, 0.0, 2.0], "ascending"),
    ([1.0] * 511, list(range(511)), "bits must be in 1..8"),
])
def test_bad_relu_sums_are_refused(w, c, match):
    with pytest.raises(ValueError, match=match):
        ReLUSum(w, c)


@pytest.mark.parametrize("bits", [0, 9, -1])
def test_bits_out_of_range(gelu, bits):
    with pytest.raises(ValueError, match="bits must be in 1..8"):
        ReluSumObjective(gelu, bits, "primitive", (-6, 6))


def test_nan_knots_are_refused(gelu):
    obj = ReluSumObjective(gelu, 2, "primitive", (-6, 6))
    with pytest.raises(ValueError, match="finite"):
        obj(np.array([np.nan, 0.0, 1.0]))


def test_tanh_is_refused_by_the_objective():
    with pytest.raises(ValueError, match="h does not tend to 0"):
        ReluSumObjective(get_activation("tanh"), 2, "primitive", (-6, 6))
