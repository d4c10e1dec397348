"""``approxbp plan --pareto``: the curve from the exact step to the lowest peak any plan reaches, each point within
its budget, the moves' stretch below the approximations' reach; written as text, JSON and a figure."""

import json

import pytest

from approxbp.cli import main
from approxbp.planner.pareto import pareto
from approxbp.planner.request import Request

MODEL = "llama:hidden_size=64,num_hidden_layers=2,intermediate_size=128,num_attention_heads=4,vocab_size=4096"


@pytest.mark.slow
def test_the_curve_runs_from_the_exact_peak_to_below_the_approximations_reach():
    curve = pareto(Request(model=MODEL, batch=2, seq=256, setup="bf16"), gpu="h100", points=3)
    first, last = curve[0], curve[-1]
    assert first.plan == "2 × exact" and first.error == 0 and first.peak == first.budget
    assert all(c.peak <= c.budget for c in curve), curve
    approximations = [c for c in curve if ";" not in c.plan]
    moves = [c for c in curve if ";" in c.plan]
    assert approximations and moves and last.peak < min(c.peak for c in approximations)
    assert [c.budget for c in curve] == sorted((c.budget for c in curve), reverse=True)
    assert last.seconds > first.seconds > 0  # the moves cost modelled time


@pytest.mark.slow
def test_the_cli_writes_the_curve_and_refuses_it_without_a_gpu(tmp_path, capsys):
    out, fig = tmp_path / "curve.json", tmp_path / "curve.png"
    assert main(["plan", MODEL, "--batch", "2", "--seq", "256", "--gpu", "a100", "--pareto", "2", "--out", str(out),
                 "--figure", str(fig), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "a model, not a measurement" in text and "NVIDIA A100" in text
    data = json.loads(out.read_text())
    assert data["gpu"] == "a100" and len(data["curve"]) >= 3 and fig.stat().st_size > 0
    assert main(["plan", MODEL, "--pareto", "3"]) == 2
    assert "--pareto needs --gpu" in capsys.readouterr().err
    with pytest.raises(ValueError, match="expected at least 2 points"):
        pareto(Request(model=MODEL, batch=2, seq=256, setup="bf16"), gpu="h100", points=1)
