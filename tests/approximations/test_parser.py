"""The restricted expression parser (approximations/expressions.py) and the activation checks on top of it: every
bad expression is refused in one line, before anything is built or evaluated."""

import subprocess
import sys
import tracemalloc

import pytest
from _helpers import table_json as _table
from _helpers import write_json as _write
from approxbp.approximations import get_activation
from approxbp.approximations import table_schema as TS
from approxbp.approximations import tables as table_files
from approxbp.approximations.expressions import ExpressionError
from approxbp.kernels import (
    InvActivation,
    ReLUSumActivation,
)
from approxbp.kernels.codegen import export

from approxbp.cli import main


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
    tracemalloc.start()
    try:
        with pytest.raises(ExpressionError, match=msg):
            get_activation(text)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20, peak  # refused before the number is built (the nested power ran out of memory)


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


# ---- moved from test_trust.py (untrusted input, atomic writes, numerics: no silent wrong answers) ----


MARKER = "approxbp-pwned-marker"




PAYLOADS = [
    f"__import__('os').system('touch {MARKER}') + y",
    "y.__class__.__mro__[1].__subclasses__()",
    "(lambda: y)()",
    "'abc' + y",
    "[y][0]",
    "y if y else y",
    "y.real",
]


@pytest.mark.parametrize("payload", PAYLOADS)
def test_invact_branch_payload_is_refused_without_running(tmp_path, monkeypatch, capsys, payload):
    """The CLI's `export` refuses each payload in-process; the first (a shell command) also in a process of its own,
    as a user runs it."""
    monkeypatch.chdir(tmp_path)
    t = _table("invact/gelu-paper")
    t["left"]["expression"] = payload
    p = _write(tmp_path, t)
    with pytest.raises(TS.TableError, match="left.expression"):
        table_files.load(p)
    with pytest.raises(RuntimeError, match="approxbp export"):  # run time never parses it: it has no kernels
        InvActivation(str(p))
    assert main(["export", str(p), "--out-dir", str(tmp_path)]) == 2
    assert "left.expression" in capsys.readouterr().err
    if payload == PAYLOADS[0]:
        r = subprocess.run([sys.executable, "-m", "approxbp.cli", "export", str(p), "--out-dir", str(tmp_path)],
                           capture_output=True, text=True)
        assert r.returncode == 2 and "left.expression" in r.stderr
    assert not (tmp_path / MARKER).exists()


def test_relu_sum_expression_payload_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    t = _table("relu_sum/gelu-k2-primitive")
    t["expression"] = ("x.__class__.__new__.__globals__['__builtins__']['__import__']('os').system("
                       f"'touch {MARKER}') or x*Phi(x)")
    t["activation"] = "custom"
    p = _write(tmp_path, t)
    with pytest.raises(TS.TableError, match="expression"):  # export (the build side) refuses it
        export([p], tmp_path)
    with pytest.raises(RuntimeError, match="approxbp export"):
        ReLUSumActivation(p)
    r = subprocess.run([sys.executable, "-m", "approxbp.cli", "fit", "relu-sum", "--activation",
                        t["expression"], "--bits", "1"], capture_output=True, text=True)
    assert r.returncode == 2 and "not allowed" in r.stderr
    assert not (tmp_path / MARKER).exists()


@pytest.mark.parametrize("text,msg", [("Max(0, exp(x) - 3*x)", "kinks cannot be located"), ("x/0", "singular"),
                                      ("1/x", "singular"),
                                      ("log(x)", "singular"), ("10**10**10", "too large"), ("x(2)", "not an allowed")])
def test_bad_activation_expressions_get_one_clear_line(text, msg):
    from approxbp.approximations import get_activation

    with pytest.raises(ValueError, match=msg) as err:
        get_activation(text)
    assert "Traceback" not in str(err.value)


def test_form_names_must_be_identifiers():
    from approxbp.approximations.invact_forms import Form

    with pytest.raises(ValueError, match="identifier"):
        Form.parse("y + a", {"os.system": 1.0})
    with pytest.raises(ExpressionError):
        Form.parse("y + a", {"a": 1.0}, [["c", "os.system"]])


def test_piecewise_is_parsed_into_nested_selects():
    """Piecewise((a, cond), …, (z, True)) is select(c, a, …) with each condition written c > 0 (issue 47); the
    conditions are single comparisons, the last piece's is True, and nothing else takes a comparison."""
    import numpy as np
    from approxbp.approximations import get_activation

    elu = get_activation("Piecewise((x, x > 0), (exp(x) - 1, True))")
    assert elu.expression == "select(x, x, exp(x) - 1)" and elu.kinks() == [0.0]
    grid = np.linspace(-5, 5, 101)
    assert np.allclose(elu.f(grid), get_activation("elu").f(grid), rtol=1e-15, atol=1e-16)
    assert np.allclose(elu.df(grid), get_activation("elu").df(grid), rtol=1e-15, atol=1e-16)
    hs = get_activation("Piecewise((0, x < -3), (x, x >= 3), (x*(x + 3)/6, True))")
    assert np.allclose(hs.f(grid), get_activation("hardswish").f(grid), rtol=1e-15, atol=1e-16)
    for bad, msg in (("Piecewise((x, x > 0))", "last piece"), ("Piecewise((x, 0 < x < 1), (0, True))", "comparison"),
                     ("Piecewise((x, x > 0), (0, x < 0))", "last piece"), ("x > 0", "not allowed"),
                     ("Piecewise(x, True)", "pairs")):
        with pytest.raises(ValueError, match=msg):
            get_activation(bad)


@pytest.mark.parametrize("spelled", ["where(x > 0, x**2, 0.05*x)", "x**2 if x > 0 else 0.05*x",
                                     "select(x > 0, x**2, 0.05*x)", "where(0 < x, x**2, x/20)",
                                     "Piecewise((x**2, x > 0), (0.05*x, True))"])
def test_a_two_piece_activation_is_read_as_people_write_it(spelled):
    """numpy's where(c, a, b), Python's a if c else b and select with a comparison all read as the Piecewise the
    grammar takes (issue 69: where was an unknown name); a condition that is no comparison is refused with the
    spelling that works."""
    from approxbp.approximations import get_activation

    assert get_activation(spelled).expression == get_activation("select(x, x**2, x/20)").expression
    for bad, msg in (("where(x, x, 0)", "a condition is one comparison"), ("where(x > 0, x)", "where.x > 0, x, 0.1")):
        with pytest.raises(ValueError, match=msg):
            get_activation(bad)


@pytest.mark.parametrize("typed, shown", [
    ("x*sigmoid(1.702*x)", "x*sigmoid(1.702*x)"),
    ("x*sigmoid(0.3*x) - 0.05*x", "x*sigmoid(0.3*x) - 0.05*x"),
    ("1.0507009873554805*Piecewise((x, x > 0), (1.6732632423543772*(exp(x) - 1), True))",
     "1.0507009873554805*select(x, x, 1.6732632423543772*exp(x) - 1.6732632423543772)"),
    ("x*(1 + erf(x/sqrt(2)))/2", "x*Phi(x)"),  # the registry's own form; ½ and integers stay exact
    ("x*sigmoid(x)/4", "x*sigmoid(x)/4"),
])
def test_an_expression_is_echoed_with_the_decimals_typed(typed, shown):
    """Issue 60: a user's constants were echoed as exact fractions (2101401974710961*select(x, …)/2000…): typed
    decimals are parsed exactly, and shown as those decimals again."""
    from approxbp.approximations.expressions import readable

    act = get_activation(typed)
    assert act.readable == shown and readable(act.expr) == shown
    assert get_activation(shown).expr == act.expr  # the echo parses back to the same function


@pytest.mark.parametrize("typed, hint", [("x*sigmod(x)", "did you mean 'sigmoid' for 'sigmod'?"),
                                         ("sigmod", "did you mean 'sigmoid'?"),
                                         ("gelo", "did you mean 'gelu'?"),
                                         ("x*tanh(softplu(x))", "did you mean 'softplus' for 'softplu'?")])
def test_a_misspelt_name_gets_a_did_you_mean(typed, hint):
    with pytest.raises(ValueError) as refused:
        get_activation(typed)
    assert hint in str(refused.value)
