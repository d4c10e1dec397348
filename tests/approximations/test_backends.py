"""One home for the function set (approximations/backends.py). A function added there is parsed by the
grammars, evaluated by numpy, mpmath, torch and Arb, and printed into Triton and into the PyTorch twin; a function
without a Triton form is refused by export, by name."""

import math

import mpmath
import numpy as np
import pytest
import sympy as sp
import torch
from approxbp.approximations import backends, get_activation
from approxbp.approximations.invact_forms import Form
from approxbp.kernels.codegen import activation_twin, triton_source

ASINH = backends.Fn("asinh", lambda: sp.asinh, arb=(lambda z: z.asinh(), lambda z: 1 / (1 + z * z).sqrt()),
                    triton="tl.log({0} + tl.sqrt({0} * {0} + 1.0))", fp32_ulps=4.0)


def test_an_unknown_function_is_refused_everywhere():
    with pytest.raises(ValueError, match="asinh"):
        get_activation("x*asinh(x)")
    with pytest.raises(ValueError, match="asinh"):
        Form.parse("asinh(y)")


def test_one_entry_adds_a_function_to_parser_evaluators_and_printers(monkeypatch):
    monkeypatch.setitem(backends.FUNCTIONS, "asinh", ASINH)
    act = get_activation("x*asinh(x)")  # the activation grammar
    assert Form.parse("asinh(y)").expression == sp.asinh(sp.Symbol("y", real=True))  # the form grammar
    xs = np.array([-3.0, -0.5, 0.0, 0.25, 2.0])
    want = xs * np.arcsinh(xs)
    assert np.allclose(act.f(xs), want, rtol=1e-15, atol=0)  # numpy
    with mpmath.workdps(50):
        assert abs(act.mp(0.25, dps=None) - mpmath.mpf(0.25) * mpmath.asinh(mpmath.mpf(0.25))) < mpmath.mpf(10) ** -45
    got = act.torch_fn(0)(torch.tensor(xs))
    assert torch.allclose(got, torch.tensor(want), rtol=1e-15, atol=0)  # torch
    from approxbp.fitting.intervals import Ball, Evaluator, precision
    from flint import arb

    with precision():  # the certifier's working precision
        ball = Evaluator()(act.expr, {act.expr.free_symbols.pop(): Ball(arb(0.25), arb(1))})  # Arb
        assert ball.v.contains(arb(0.25) * arb(0.25).asinh()) and float(ball.v.rad()) < 1e-30
    code = triton_source(act.expr)  # the Triton printer
    assert "tl.log(x + tl.sqrt(x * x + 1.0))" in code
    namespace = {"tl": _FakeTl()}
    assert math.isclose(eval(code, namespace, {"x": 0.25}), 0.25 * math.asinh(0.25), rel_tol=1e-15)
    twin = {}
    exec(activation_twin(act, 0, "h"), {**backends.torch_namespace()}, twin)  # the PyTorch twin's printer
    assert torch.allclose(twin["h"](torch.tensor(xs)), torch.tensor(want), rtol=1e-15, atol=0)


class _FakeTl:
    """tl.log, tl.sqrt on Python floats: enough to evaluate a printed scalar expression."""

    log, sqrt, exp = staticmethod(math.log), staticmethod(math.sqrt), staticmethod(math.exp)


def test_a_function_without_a_triton_form_parses_evaluates_and_is_refused_by_export():
    act = get_activation("x*atan(x)")
    assert np.isclose(act.f(np.array([2.0]))[0], 2 * math.atan(2.0))
    with pytest.raises(ValueError, match="cannot lower atan to Triton"):
        triton_source(act.expr)


def test_the_derived_tables_agree_with_the_function_set():
    from approxbp.fitting import intervals

    names = {f.name for f in backends.functions()}
    assert set(backends.torch_namespace()) >= names
    assert set(intervals.FP32_ULPS) == {"add", "mul", "div"} | {f.name for f in backends.functions()
                                                               if f.fp32_ulps is not None}
    assert {"softplus", "log1p", "expm1", "abs"} <= set(backends.grammar("activation"))
    # select is in both: Piecewise(…) becomes selects, and a table of it must read back (issue 47)
    assert "select" in backends.grammar("form") and "select" in backends.grammar("activation")
    assert "log1p" not in backends.grammar("form")
