"""benchmarks/planner_vs_compile.py on a tiny LLaMA (the committed results are the script's on a larger one): each
curve's points are measured where they run — compile's partitioned graphs under the roofline, a lower budget
saving no more than a higher one allows, recomputed blocks charged again — and the committed results file has the
four curves (compile, ours exact, ours with approximations, ours under compile's budget)."""

import json
import runpy

import pytest
from _helpers import ROOT

pytest.importorskip("transformers")
SCRIPT = runpy.run_path(str(ROOT / "benchmarks" / "planner_vs_compile.py"))
TINY = "llama:hidden=64,layers=2,heads=4,kv_heads=4,intermediate=128,vocab=128"


@pytest.fixture(scope="module")
def points():
    from approxbp.planner.gpus import gpu

    _, make_inputs = SCRIPT["_model"](TINY)
    inputs = make_inputs(2, 32)
    device = gpu("h100")
    return (SCRIPT["compiled"](TINY, inputs, device, budgets=(1.0, 0.0)),
            SCRIPT["ours"](TINY, inputs, device, approximate=False))


@pytest.mark.slow
def test_compile_at_budget_zero_saves_less_and_recomputes(points):
    full, none = points[0]
    assert none["saved_bytes"] < full["saved_bytes"] and none["seconds"] > full["seconds"] > 0, points[0]


@pytest.mark.slow
def test_each_recomputed_block_saves_bytes_and_costs_time(points):
    ours = points[1]
    assert [p["recomputed_blocks"] for p in ours] == [0, 1, 2]
    assert all(a["saved_bytes"] > b["saved_bytes"] and a["seconds"] < b["seconds"] for a, b in zip(ours, ours[1:]))


def test_the_committed_results_have_the_four_curves():
    result = json.loads((ROOT / "benchmarks" / "results" / "planner_vs_compile.json").read_text())
    assert {"compile", "ours_exact", "ours_approx", "compile_approx", "gpu", "model"} <= set(result)
    assert all(len(result[k]) >= 2 for k in ("compile", "ours_exact", "ours_approx", "compile_approx"))


@pytest.mark.slow
def test_the_approximations_under_compiles_budget_form_a_curve_of_their_own():
    """The combination (the patched model, ReLU-sum k = 2 and MS-norms, compiled at each budget): a lower budget
    saves less and recomputes more, as compile alone does."""
    from approxbp.planner.gpus import gpu

    _, make_inputs = SCRIPT["_model"](TINY)
    full, none = SCRIPT["compiled"](TINY, make_inputs(2, 32), gpu("h100"), budgets=(1.0, 0.0), approximate=True)
    assert none["saved_bytes"] < full["saved_bytes"] and none["seconds"] > full["seconds"] > 0, (full, none)
