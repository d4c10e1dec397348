"""torch.compile's ``activation_memory_budget`` as a planner move (issue 46): the curve with it is never slower than
compile alone, a plan that compiles fits its budget, and applied to a real model it saves exactly the planned bytes
and trains as stock."""

import pytest
import torch
from _plans import share_points

from approxbp.cli import main
from approxbp.planner.compiled import budget_backend, point
from approxbp.planner.gpus import gpu
from approxbp.planner.pareto import CurvePoint, frontier, pareto
from approxbp.planner.plan import plan
from approxbp.planner.report import report
from approxbp.planner.request import Request
from approxbp.planner.training import Setup

MODEL = "llama:hidden_size=64,num_hidden_layers=2,intermediate_size=128,num_attention_heads=4,vocab_size=4096"
BUDGETS = (1.0, 0.0)


@pytest.fixture(scope="module", autouse=True)
def _each_point_compiled_once(tmp_path_factory):
    """The curve's compiled points are the plan's and the test's own (the same assignment at the same budget), once
    per test run."""
    with pytest.MonkeyPatch.context() as mp:
        share_points(mp, tmp_path_factory)
        yield


@pytest.fixture(scope="module")
def curve():
    return pareto(Request(model=MODEL, batch=2, seq=256, setup="bf16"), gpu="h100", points=3, compile_budgets=BUDGETS)


@pytest.mark.slow
def test_the_curve_with_compile_is_never_slower_than_compile_alone(curve):
    alone = [point(Request(model=MODEL, batch=2, seq=256, setup=Setup(), lora_r=8), gpu("h100"), {}, False,
                   b) for b in (None, *BUDGETS)]
    eager_saved = alone[0][0]
    exact_peak = pareto(Request(model=MODEL, batch=2, seq=256, setup="bf16"), gpu="h100", points=2)[0].peak
    for saved, seconds in alone[1:]:
        peak = exact_peak - eager_saved + saved
        assert any(c.peak <= peak and c.seconds <= seconds for c in curve), (peak, seconds, curve)
    assert any("torch.compile" in c.plan for c in curve)
    peaks = [c.peak for c in curve]
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == len(peaks)  # one point per peak, no ties kept


def test_the_frontier_keeps_what_nothing_beats():
    p = [CurvePoint(10, 10, 1.0, 0.0, ""), CurvePoint(8, 8, 2.0, 0.0, ""), CurvePoint(9, 9, 3.0, 0.0, ""),
         CurvePoint(10, 10, 1.0, 0.5, ""), CurvePoint(8, 8, 2.0, 0.0, "a tie, later")]
    assert frontier(p) == p[:2]


@pytest.mark.slow
def test_a_plan_that_compiles_fits_and_applied_saves_the_planned_bytes_and_trains_as_stock():
    from approxbp.planner.models import model_spec

    budget = 6 * 2**20  # below every eager plan without moves on this model
    planned = plan(Request(model=MODEL, batch=2, seq=256), budget=budget, gpu="h100", compile_budgets=BUDGETS)
    moves = planned.moves
    assert moves.compile.activation_memory_budget in BUDGETS and moves.peak <= budget
    assert "torch.compile at activation_memory_budget" in report(planned)

    from approxbp.planner.plan_step import step_inputs
    from approxbp.planner.step_memory import _loss_of, prepare

    build = model_spec(MODEL, "causal-lm")
    stock, patched = [], []
    for into in (stock, patched):
        torch.manual_seed(0)
        model, make_inputs = build()
        into.append(prepare(model, Setup(), 8))
    (stock,), (patched,) = stock, patched
    inputs = step_inputs(make_inputs, 2, 256, Setup())
    torch._dynamo.reset()
    planned.apply(patched, example_input=inputs, compile_backend="aot_eager_decomp_partition")

    from approxbp.kernels.ops.saved import saved_bytes

    losses = []
    for m in (stock, patched):
        def step(m=m):
            losses.append(_loss_of(m(**inputs)))

        saved = saved_bytes(step, exclude=list(m.parameters()))
        losses[-1].backward()
    assert saved == moves.saved
    assert torch.allclose(losses[0].float(), losses[1].float(), rtol=1e-2)
    for (name, a), b in zip(stock.named_parameters(), patched.parameters()):
        assert torch.allclose(a.grad.float(), b.grad.float(), rtol=0.02, atol=1e-3), name


def test_budget_backend_and_the_cli_refuse_what_is_not_a_fraction(capsys):
    with pytest.raises(ValueError, match=r"expected a fraction in \[0, 1\]"):
        budget_backend(1.5)
    assert main(["plan", MODEL, "--gpu", "h100", "--pareto", "2", "--compile-budgets", "2", "--no-progress"]) == 2
    assert "expected comma-separated fractions" in capsys.readouterr().err
    assert main(["plan", MODEL, "--budget", "6MiB", "--compile-budgets", "--no-progress"]) == 2
    assert "it needs --gpu and --budget" in capsys.readouterr().err
    assert main(["plan", MODEL, "--use", "exact", "--compile-budgets", "1", "--no-progress"]) == 2
    assert "not with --maximize or --use" in capsys.readouterr().err
