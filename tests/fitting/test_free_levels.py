"""FewBit's family (free levels on [−100, 100]): the objective, the grid DP, and FewBit's own tables."""

import itertools

import numpy as np
import pytest
from approxbp.fitting import grid_dp
from approxbp.fitting.free_levels import FreeLevelsObjective, fewbit_reference, fit_free_levels

from approxbp.cli import main


def test_closed_form_objective_and_gradient_agree_with_quadrature_and_differences():
    obj = FreeLevelsObjective("gelu", 2)
    c = np.array([-2.5, 0.1, 0.7])
    J, g = obj(c)
    assert J == pytest.approx(obj.loss_of(c, obj.levels(c)), rel=1e-9)  # adaptive quadrature of (h' − q)²
    h = 1e-6
    fd = [(obj(c + h * e)[0] - obj(c - h * e)[0]) / (2 * h) for e in np.eye(3)]
    np.testing.assert_allclose(g, fd, rtol=1e-5, atol=1e-10)


def test_grid_dp_is_the_exact_optimum_over_its_grid():
    obj = FreeLevelsObjective("silu", 2, (-20.0, 20.0))
    grid = grid_dp._grid(obj, 30)
    dp = grid_dp.free_levels_knots(obj, 30)
    inner = grid[1:-1]
    brute = min(itertools.combinations(inner, 3), key=lambda c: obj(np.array(c))[0])
    assert obj(dp)[0] == pytest.approx(obj(np.array(brute))[0], rel=1e-12)


def test_fewbit_tables_measured_here_match_the_published_values_and_ours_are_at_the_best_known():
    ref = fewbit_reference()
    assert len(ref) == 8
    for (act, bits), r in ref.items():
        obj = FreeLevelsObjective(act, bits, r.interval)
        measured = obj.loss_of(r.borders, r.levels)
        assert measured == pytest.approx(r.recorded, abs=6e-11), (act, bits)  # the file has 10 decimals
        ours = fit_free_levels(act, bits, r.interval).loss
        assert ours <= r.best_found * (1 + 1e-8), (act, bits)  # the peer file's independent global search
        assert ours <= r.recorded * (1 + 1e-9)
    # where FewBit's builtin tables are local optima, by these margins: +30 %, +57 %, +14 %
    for (act, bits), above in {("gelu", 4): 0.30, ("silu", 3): 0.57, ("silu", 4): 0.14}.items():
        assert ref[act, bits].recorded / fit_free_levels(act, bits).loss - 1 == pytest.approx(above, abs=0.005)


def test_cli_free_levels(capsys, tmp_path):
    assert main(["fit", "relu-sum", "--activation", "silu", "--bits", "3", "--levels", "free",
                 "--out", str(tmp_path / "q.json")]) == 0
    out = capsys.readouterr().out
    assert "FewBit   builtin table 2.79082626" in out and "57.3 % above ours" in out
    assert (tmp_path / "q.json").is_file()
    assert main(["fit", "relu-sum", "--activation", "silu", "--bits", "3", "--levels", "free",
                 "--objective", "primitive"]) == 2
    assert main(["fit", "relu-sum", "--activation", "silu", "--bits", "3", "--interval", "1", "9"]) == 2
    assert "expected finite A < 0 < B" in capsys.readouterr().err  # eq. 13's own interval must hold 0


def test_free_levels_fit_any_bit_width():
    """k = 7 (127 borders) has no grid-DP start size of its own (GRIDS is empty there): it uses the largest grid."""
    fit = fit_free_levels("gelu", 7, (-10.0, 10.0), restarts=1)
    assert fit.borders.size == 127 and np.all(np.diff(fit.borders) > 0) and fit.loss < 1e-4


def test_a_free_level_fit_goes_through_export_kernels_patch_cost_and_certify(tmp_path, monkeypatch):
    """Issue 47 item 5: hard-sigmoid's k = 2 free levels are its derivative exactly (borders ±3, levels 0, 1/6, 0,
    0); the table is a ReLU-sum table with levels_rule free, exported to the ReLU-sum kernels (codes → levels: the
    Triton kernel under TRITON_INTERPRET=1 and the torch twin give torch's Hardsigmoid gradient), swapped in by
    patch_model from a mapping, costed, and certified (its objective; eq. 13's global search is not attempted)."""
    import torch
    from approxbp.approximations import tables as table_files
    from approxbp.fitting.certify import certify_table
    from approxbp.kernels import ReLUSumActivation, patch_model

    from approxbp.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["fit", "relu-sum", "--levels", "free", "--activation", "hardsigmoid", "--bits", "2", "--out",
                 "hs.json", "--no-progress"]) == 0
    t = table_files.load(tmp_path / "hs.json")
    assert t.levels_rule == "free" and t.name == "hardsigmoid-k2-derivative-free"
    # the exact step function: its level changes at −3 and 3 (where the third knot falls, with no change of level, is
    # a tie among optima: numpy builds have put it at either end)
    changes = [c for c, a, b in zip(t.knots, t.levels, t.levels[1:]) if abs(b - a) > 1e-12]
    assert np.allclose(changes, [-3, 3], atol=1e-9) and max(t.levels) == pytest.approx(1 / 6, abs=1e-12)
    assert np.allclose(sorted(set(np.round(t.levels, 12))), [0, 1 / 6], atol=1e-12)
    assert main(["export", "hs.json"]) == 0
    x = torch.randn(500) * 5  # away from ±3, where a fitted border (3 ± 1e-9) may fall either side of torch's
    g = torch.randn_like(x)
    xr = x.clone().requires_grad_()
    torch.nn.Hardsigmoid()(xr).backward(g)
    want = xr.grad
    for use_triton in (False, True):
        xs = x.clone().requires_grad_()
        ReLUSumActivation(tmp_path / "hs.json", use_triton=use_triton)(xs).backward(g)
        torch.testing.assert_close(xs.grad, want, rtol=1e-6, atol=1e-7)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Hardsigmoid(), torch.nn.Linear(8, 2))
    report = patch_model(net, tables={"Hardsigmoid": str(tmp_path / "hs.json")}, example_input=torch.randn(16, 4))
    assert report.activations and "hardsigmoid-k2-derivative-free" in report.activations[0], report
    assert report.saved_bytes[1] < report.saved_bytes[0]
    entry, lines, ok = certify_table(t)
    assert ok and "free levels: the branch and bound is eq. 13's" in "\n".join(lines), lines
