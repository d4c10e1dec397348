"""Certified numerics (fitting/certify.py, fitting/intervals.py): every bound must hold against independent
references (mpmath at 50 digits, scipy quad, a float32 emulation), and a wrong table must fail its claim."""

import json
import math

import mpmath
import numpy as np
import pytest
import sympy as sp
from approxbp.approximations import get_activation
from approxbp.approximations.activations import x as X
from approxbp.approximations.elementary import LG2_ABS_ERROR, LN2
from approxbp.approximations.invact import InvertedActivation
from approxbp.approximations.invact_forms import Form
from approxbp.approximations.table_schema import TableError
from approxbp.approximations.tables import data_dir, from_json, load
from approxbp.fitting import certify as C  # the module, whatever was imported before
from approxbp.fitting import intervals as iv
from approxbp.fitting.result import Verdict
from flint import arb

from approxbp.cli import main

INVACT = data_dir() / "invact"
RELU = data_dir() / "relu_sum"


@pytest.mark.parametrize("name", ["gelu", "silu", "mish", "gelu_tanh"])
@iv.at_precision
def test_ball_evaluation_encloses_mpmath_values_and_slopes(name):
    act = get_activation(name)
    ev = iv.Evaluator()
    rng = np.random.default_rng(0)
    for _ in range(40):
        lo = rng.uniform(-12, 12)
        hi = lo + 10 ** rng.uniform(-6, 0.5)
        ball = ev(act.expr, {X: iv.Ball(iv.box(lo, hi), arb(1))})
        for v in np.linspace(lo, hi, 5):
            with mpmath.workdps(40):
                f, df = act.mp(v, 0, None), act.mp(v, 1, None)
            for got, ref in ((ball.v, f), (ball.d, df)):  # the reference to 1e-30 (its printed digits)
                assert got.overlaps(arb(mpmath.nstr(ref, 35), 1e-30 * max(1.0, abs(float(ref))))), (name, lo, v)


def test_log_error_bound_covers_the_stated_lg2_error():
    """The kernels' log is lg2.approx(v)·float32(ln 2): at |log v| = 0 the bound is lg2's absolute error times ln 2,
    and it grows by the rounded constant's relative error (2.2e-8) plus one rounding per unit of |log v|."""
    A, B = C.log_error()
    assert LG2_ABS_ERROR * LN2 <= A <= 1.0001 * LG2_ABS_ERROR * LN2
    c = float(np.float32(LN2))
    assert B == pytest.approx((abs(c - LN2) + 2.0**-24 * c) / LN2, rel=1e-9) and B < 1e-7


@pytest.mark.slow
def test_invact_certificate_is_a_bound_and_meets_the_claim():
    t = load(INVACT / "gelu-fast.json")
    cert = C.certify_invact_branch(t, "right", budget_s=math.inf, rtol=0.5, max_boxes=100_000)  # 48 126 needed
    assert cert.passed and cert.bound <= 1e-6
    assert cert.bound >= t.metrics["linf_right"]  # never below the sampled maximum
    # never below the error found by 50-digit root finding, near the attained point and elsewhere
    ia = InvertedActivation(get_activation("gelu"))
    q = Form.from_table(t.right)
    xs = np.concatenate([cert.where + np.linspace(-1e-3, 1e-3, 11), np.linspace(t.turning_point, 8, 40)[1:]])
    for xv in xs:
        yv = float(ia.activation.f(xv))
        if yv > t.right.domain[1]:
            continue
        err = abs(float(q(np.array([yv]))[0]) - float(ia.g_mp(yv, "right")))
        assert err <= cert.bound, (xv, err, cert.bound)


def _perturbed(path, scale=1 + 1e-4):
    d = json.loads(path.read_text())
    for part in ("left", "right", "combined"):
        if part in d:
            d[part]["coefficients"]["p0"] *= scale
    d["metrics"].pop("certified", None)
    return d


def test_a_perturbed_invact_table_fails_its_claim():
    t = from_json(_perturbed(INVACT / "gelu-fast.json"))
    cert = C.certify_invact_branch(t, "left", budget_s=math.inf, rtol=0.5, max_boxes=10_000)
    assert not cert.passed
    assert cert.attained > 1e-6  # a rigorous witness of the violation, not only a loose bound


@pytest.mark.parametrize("name", ["gelu", "silu"])
@pytest.mark.slow
def test_newton_certificate_is_a_bound_beside_50_digit_errors(name):
    """The newton forms' steps are bounded by error propagation (certify.NewtonSteps), not by enclosing them: the
    bound must hold against the rule evaluated in float64 and g from 50-digit root finding, on the whole branch
    (silu's right tail rule q = h′(y) included: it is the branch's largest error, 2.7e-7, which the table's
    sampled L∞ once missed)."""
    t = load(INVACT / f"{name}-newton.json")
    ia = InvertedActivation(get_activation(name))
    rule = C.InvactRule(t, "left", rounded=False)
    assert rule.newton is not None and rule.newton.steps == 2
    import torch
    from approxbp.approximations.invact_forms import TableBackward

    q = TableBackward(t)
    for branch, xs in (("left", -np.geomspace(1e-3, 30, 60) + t.turning_point),
                       ("right", np.concatenate([np.geomspace(1e-3, 30, 60) + t.turning_point, [9.72212]]))):
        cert = C.certify_invact_branch(t, branch, budget_s=math.inf, max_boxes=50_000)  # ≤ 8 886 needed
        assert cert.passed and cert.bound >= t.metrics[f"linf_{branch}"]
        ys = ia.activation.f(np.concatenate([xs, [cert.where]]))
        got = q(torch.tensor(ys, dtype=torch.float64), torch.full(ys.shape, branch == "left")).numpy()
        for yv, qv in zip(ys, got):
            if branch == "left" and yv > -1e-280:  # the left branch's open end, beyond float64
                continue
            err = abs(qv - float(ia.g_mp(float(yv), branch)))
            assert err <= cert.bound * (1 + 1e-9) + 1e-15, (branch, yv, err, cert.bound)


def test_a_perturbed_newton_table_fails_and_a_changed_step_is_not_trusted():
    d = json.loads((INVACT / "gelu-newton.json").read_text())
    d["metrics"].pop("certified")
    d["right"]["coefficients"]["p0"] *= 1 + 1e-2  # x₀ 1 % off: one Newton step leaves ~1e-5
    cert = C.certify_invact_branch(from_json(d), "right", budget_s=math.inf, rtol=0.5, max_boxes=10_000)
    assert not cert.passed and cert.attained > cert.claim
    d = json.loads((INVACT / "gelu-newton.json").read_text())
    d["metrics"].pop("certified")
    d["right"]["assignments"][2][1] = d["right"]["assignments"][2][1].replace("d0**2", "2*d0**2")  # a half step
    assert C.InvactRule(from_json(d), "right", rounded=False).newton is None  # not Newton: enclosed directly


def test_float32_evaluation_bound_covers_a_float32_emulation():
    """The running error bound of the fast form must exceed what float32 evaluation (numpy, no FMA) deviates
    from the same form in float64."""
    t = load(INVACT / "gelu-fast.json")
    f32 = C.float32_error(t, "right", budget_s=math.inf, max_boxes=400)
    form = Form.from_table(t.right)
    y32 = np.linspace(t.f_T, 8.0, 3001).astype(np.float32)
    fn = sp.lambdify([sp.Symbol("y", real=True), *[sp.Symbol(k) for k in form.coefficients]],
                     form.full(), modules=[{"Max": np.maximum, "select": lambda c, a, b: np.where(c > 0, a, b)},
                                           "numpy"])
    with np.errstate(all="ignore"):
        lo = fn(y32, *[np.float32(v) for v in form.coefficients.values()]).astype(np.float64)
        hi = form(y32.astype(np.float64))
    assert np.all(np.abs(lo - hi) <= f32.bound + 1e-12)


def test_cli_certifies_and_fails_a_wrong_table(tmp_path, capsys):
    assert main(["certify", str(RELU / "gelu-k1-derivative.json"), "--no-progress"]) == 0
    assert "gap 0.00e+00" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_perturbed(INVACT / "silu-fast.json", 1 + 1e-3)))
    assert main(["certify", str(bad), "--budget", "inf", "--max-boxes", "10000", "--rtol", "0.5", "--no-progress"]) == 1
    assert "FAILED" in capsys.readouterr().out


def test_tables_refuse_a_certified_bound_below_the_sampled_error():
    d = json.loads((INVACT / "gelu-fast.json").read_text())
    d["metrics"]["certified"] = {s: {"bound": 1e-9, "attained": 1e-9, "claim": 1e-6, "float32_evaluation": 0.0}
                                 for s in ("left", "right")}
    with pytest.raises(TableError, match="not a bound"):
        from_json(d)
    assert math.isfinite(load(INVACT / "gelu-fast.json").metrics["linf_left"])


@pytest.mark.slow
def test_reproduce_full_stores_certificates_and_fails_on_a_wrong_table(tmp_path, capsys):
    from approxbp.commands.reproduce import certify_regenerated

    good = tmp_path / "relu_sum" / "gelu-k1-derivative.json"
    good.parent.mkdir()
    d = json.loads((RELU / "gelu-k1-derivative.json").read_text())
    d["metrics"].pop("certified", None)
    good.write_text(json.dumps(d))
    assert certify_regenerated([good], progress=False)
    assert load(good).metrics["certified"]["global_gap"] == 0.0
    bad = tmp_path / "invact" / "silu-fast.json"
    bad.parent.mkdir()
    bad.write_text(json.dumps(_perturbed(INVACT / "silu-fast.json", 1 + 1e-3)))
    assert not certify_regenerated([bad], progress=False)
    assert "VIOLATED" in capsys.readouterr().out


def test_fitting_certify_is_the_module_and_not_callable():
    import approxbp.fitting as F

    assert F.certify is C and isinstance(F.certify, type(F)) and "certify" not in F.__all__
    with pytest.raises(TypeError, match="not callable"):
        F.certify(None, None)


def test_the_working_precision_is_scoped():
    """Arb's precision is the certifier's only inside it: a caller's precision is what it was after a certificate."""
    from flint import ctx

    before = ctx.prec
    with iv.precision():
        assert ctx.prec == iv.PRECISION
    assert ctx.prec == before
    C.log_error()  # decorated: at PRECISION inside
    assert ctx.prec == before


@pytest.fixture(scope="module")
def gelu_k2_search_once():
    """The gelu k = 2 derivative table's global search, run once per (table, box count) in this module: the two
    cut-short tests below both stop it at 5 boxes, and its convex-box proof alone takes ~25 s before the first box."""
    from _plans import share_calls

    done: dict = {}
    with pytest.MonkeyPatch.context() as mp:
        share_calls(mp, C, "certify_relu_sum_global", done, lambda t, **options: (t.name, options.get("max_boxes")))
        yield done


@pytest.mark.slow
def test_a_relu_sum_global_certificate_cut_short_says_budget_not_a_wrong_table(gelu_k2_search_once):
    """A branch and bound stopped by its box budget printed "NOT CERTIFIED", which reads like a wrong table (the
    InvAct lines said "(budget)")."""
    from approxbp.approximations import tables as table_files
    from approxbp.fitting.certify import certify_table

    t = table_files.as_table(table_files.load("relu_sum/gelu-k2-derivative"))
    _, lines, ok = certify_table(t, 60, max_boxes=5)
    assert not ok and "not certified (budget" in lines[-1] and "NOT CERTIFIED" not in lines[-1], lines[-1]
    assert ok is Verdict.OPEN  # the objective is enclosed; only the optimality search is open


@pytest.mark.slow
def test_certify_exits_3_when_only_the_budget_left_a_certificate_open(capsys, gelu_k2_search_once):
    """Issue 60: `approxbp certify` printed FAILED and exited 1 when the loss was enclosed and only the k ≤ 2
    global-optimality branch and bound was open within its budget. Open is its own verdict and exit status (3);
    a violated claim still exits 1 (the wrong-table test above)."""
    from approxbp.commands.certify import OPEN_EXIT

    assert OPEN_EXIT == 3
    assert main(["certify", "relu_sum/gelu-k2-derivative", "--max-boxes", "5", "--no-progress"]) == 3
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert "open within the budget" in last and "FAILED" not in last and "gelu-k2-derivative" in last, last


def test_verdicts_combine_to_the_worse():
    V = Verdict
    assert (V.HELD & V.OPEN) is V.OPEN and (V.OPEN & V.FAILED) is V.FAILED and (V.HELD & V.HELD) is V.HELD
    assert bool(V.HELD) and not V.OPEN and not V.FAILED
    assert V.of(True, violated=True) is V.HELD and V.of(False, violated=True) is V.FAILED
    assert V.of(False, violated=False) is V.OPEN


def test_each_certificate_line_is_emitted_as_soon_as_it_is_done(capsys):
    """`approxbp certify --no-progress` was silent until a whole table was done (minutes for an InvAct table): each
    branch's line is now handed out as its certificate ends, and the CLI prints it then (issue 47)."""
    from approxbp.approximations.tables import load
    from approxbp.fitting.certify import certify_table

    from approxbp.commands.certify import print_certificates

    seen = []
    _, lines, ok = certify_table(load("invact/relu2-exact"), emit=seen.append)
    assert ok and seen == list(lines) and len(seen) == 2 and "left" in seen[0] and "right" in seen[1]
    held = print_certificates(["invact/relu2-exact"], progress=False, write=False)
    assert list(held.values()) == [Verdict.HELD] and capsys.readouterr().out.count("relu2-exact") == 2


def _hardsigmoid_at_the_floor(ulps: int):
    """Hard-sigmoid's k = 2 free levels with the borders ``ulps`` ulps outside ±3 (where a fit on another machine's
    libm/BLAS lands): h′ is matched exactly but on those few ulps, so the loss is ~1e-17 from terms ∫h′² = 1/6."""
    from approxbp.fitting.free_levels import FreeLevelsFit, FreeLevelsObjective

    step = math.ulp(3.0)
    borders = np.array([-3.0 - ulps * step, 3.0 + ulps * step, 33.515799])
    obj = FreeLevelsObjective("hardsigmoid", 2, (-100.0, 100.0))
    return FreeLevelsFit("hardsigmoid", 2, (-100.0, 100.0), borders, obj.levels(borders), 0.0, {}).table()


def test_a_recorded_loss_at_the_float64_floor_is_compared_with_its_own_rounding():
    """Issue 60: a loss at the float64 floor is recorded with an absolute rounding error (the float evaluation
    cannot place a point between a border one ulp from the kink and the kink), which a relative 1e-12 did not admit:
    the certificate holds, is written and validates on read; a recorded loss off by more than that rounding fails."""
    from approxbp.approximations.table_checks import recorded_loss_slack
    from approxbp.fitting.optimality import relu_sum_objective

    t = _hardsigmoid_at_the_floor(1)
    enclosure = relu_sum_objective(t)
    exact = float(enclosure.mid())
    assert 1e-17 < exact < 1e-16 and abs(t.loss - exact) > 1e-12 * exact  # the old relative test fails here
    slack = recorded_loss_slack(t.objective, t.interval, t.knots, t.levels, t.loss)
    assert abs(t.loss - exact) < slack < 1e-15  # ∫h̃² = 1/6: (n + 2)·u·2·(3/6 + …) ≈ 5.6e-16
    entry, lines, ok = C.certify_table(t)
    assert ok and "within its float64 rounding" in lines[0], lines
    from_json(t.with_metrics(certified=entry).to_json())  # the written certificate validates on read
    wrong = from_json({**t.to_json(), "loss": exact + 10 * slack})
    _, lines, ok = C.certify_table(wrong)
    assert not ok and "OUTSIDE: FAILED" in lines[0]
    with pytest.raises(TableError, match="float64 rounding"):
        from_json({**wrong.to_json(), "metrics": {**wrong.to_json()["metrics"], "certified": entry}})


def test_the_loss_slack_is_tight_on_a_packaged_table():
    """The rounding allowance is the float64 error of the loss's terms, not a blanket tolerance: on the packaged
    GELU k = 2 primitive table it is below 1e-9 of the loss, and the stored certificate still holds."""
    from approxbp.approximations.table_checks import recorded_loss_slack

    t = load(RELU / "gelu-k2-primitive.json")
    slack = recorded_loss_slack(t.objective, t.interval, t.knots, t.levels, t.loss)
    assert 1e-12 * t.loss < slack < 1e-9 * t.loss
