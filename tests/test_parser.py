"""The restricted expression parser (approximations/expressions.py) and the activation checks on top of it: every
bad expression is refused in one line, before anything is built or evaluated."""

import time

import pytest
from approxbp.approximations import get_activation
from approxbp.approximations.expressions import ExpressionError


@pytest.mark.parametrize("text, msg", [
    ("x*1e309", "overflows float64"),
    ("x*" + "9" * 400, "outside float64's range"),
    ("x*1e-400", "outside float64's range"),
    ("x*((2**4096)**4096)**4096", "outside float64's range"),
    ("x*(10**300)**2", "outside float64's range"),
    ("sqrt(-1)*x", "not real"),
    ("x*log(-2)", "not real"),
    ("x*(-8)**(1/3)", "not real"),
])
def test_numbers_outside_float64_and_complex_constants_are_refused_at_once(text, msg):
    t0 = time.perf_counter()
    with pytest.raises(ExpressionError, match=msg):
        get_activation(text)
    assert time.perf_counter() - t0 < 5  # refused before the number is built (the nested power ran out of memory)


@pytest.mark.parametrize("text", ["x*1e300*sigmoid(x)/1e300", "x*2**-10*sigmoid(x)*1024", "x*sigmoid(1.5*x)"])
def test_large_but_representable_numbers_still_parse_and_evaluate(text):
    act = get_activation(text)
    assert abs(float(act.f(1.0)) - get_activation("x*sigmoid(x)").f(1.0)) < 0.3


@pytest.mark.parametrize("text, msg", [
    ("x*sigmoid(x) + 1e-9/(x-0.005)", "a denominator vanishes at x = 0.005"),  # between the grid's samples
    ("x*sigmoid(x) + 1/(x**2 - 1e6)", "a denominator vanishes at x = -1000"),  # far outside [−30, 30]
    ("x*sqrt(x - 100)", "square root"),
])
def test_singularities_are_found_exactly_not_by_sampling(text, msg):
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace("*", r"\*")):
        get_activation(text)
