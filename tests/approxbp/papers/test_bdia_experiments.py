"""BDIA analysis (approxbp/papers/bdia_experiments.py): Fig. 2's shape, zero error with side bits, memory, the toy GPT
and the CLI."""

import json
import math

import pytest
import torch

from approxbp.cli import main
from approxbp.papers import bdia_experiments as F


def test_plain_reconstruction_error_doubles_per_block_and_quantised_is_zero():
    plain = F.reconstruction_errors(40, torch.float64, None)
    finite = [e for e in plain if math.isfinite(e) and e > 0]
    # the error at block k is ≈ 2^{K−k} ulp: from the top to block 0 it grows by ≳ 2^30
    assert plain[0] > 2**30 * plain[-1] > 0 and len(finite) >= 30
    ratios = [plain[k] / plain[k + 1] for k in range(5, 30)]
    assert 1.7 < sorted(ratios)[len(ratios) // 2] < 2.3  # median growth per block ≈ 1/|γ| = 2
    for level in F.LEVELS:
        assert max(F.reconstruction_errors(40, torch.float32, level)) == 0.0


def test_fp32_plain_reconstruction_overflows_for_deep_stacks():
    errs = F.reconstruction_errors(300, torch.float32, None)
    assert math.isinf(errs[0])


def test_forward_quantisation_error_shrinks_with_level():
    e = {lv: F.forward_quantisation(12, lv)[-1] for lv in (5, 9, 12)}
    assert e[5] > e[9] > e[12] > 0
    assert e[12] < 16 * 2.0**-12 * 12  # a few half-ulps of the grid per block, relative to |x| ≈ 1


def test_memory_online_is_two_states_plus_side_bits():
    m = F.memory_per_block(K=6, d=32, tokens=64)
    n = 64 * 32
    assert m["online_bytes_per_block"] * 6 == 2 * 4 * n + 5 * n // 8
    assert m["autograd_bytes_per_block"] > 20 * m["online_bytes_per_block"]


def test_reproduce_row_matches_the_papers_figure_2():
    row = F.reproduce_row()
    assert row["quantised"] == 0.0 and row["plain"] > 1e-6


def test_toy_gpt_trains_and_checks_bitwise_gradients():
    r = F.train_toy_gpt(steps=3, blocks=3, d=32, batch=2, context=16, check_every=1, progress=False)
    assert r["bdia"]["bitwise_gradient_checks_passed"] == 3
    assert r["bdia"]["saved_bytes_per_step"] < r["standard"]["saved_bytes_per_step"] / 3
    assert all(math.isfinite(v) for v in r["bdia"]["train_loss"] + r["standard"]["train_loss"])


def test_corpus_is_deterministic_and_correct():
    text = F.arithmetic_corpus(50, seed=3)
    assert text == F.arithmetic_corpus(50, seed=3)
    for line in text.splitlines():
        lhs, rhs = line.split("=")
        a, b = map(int, lhs.split("+"))
        assert a + b == int(rhs)


def test_cli_bdia_analyze(tmp_path):
    assert main(["bdia", "analyze", "--blocks", "30", "--level", "9", "--dtype", "float32", "--out",
                 str(tmp_path), "--no-progress"]) == 0
    r = json.loads((tmp_path / "bdia_analysis.json").read_text())
    assert r["reconstruction"]["float32/l=9"]["max_error"] == 0.0
    assert r["reconstruction"]["float32/plain"]["max_error"] > 0
    assert (tmp_path / "bdia_analysis.png").stat().st_size > 10_000


def test_cli_bdia_analyze_reports_levels_beyond_the_bound(tmp_path):
    """l = 30 leaves fp32 no room (bound 2^{24−30−2} < 1): the analysis records the error, never a number."""
    assert main(["bdia", "analyze", "--blocks", "8", "--level", "30", "--dtype", "float32", "--out",
                 str(tmp_path), "--no-progress"]) == 0
    r = json.loads((tmp_path / "bdia_analysis.json").read_text())
    assert "exactness bound" in r["reconstruction"]["float32/l=30"]["error"]


@pytest.mark.parametrize("bad", [["bdia", "analyze", "--dtype", "int8"], ["bdia"]])
def test_cli_bdia_rejects_bad_arguments(bad):
    with pytest.raises(SystemExit):
        main(bad)


def test_train_toy_command_prints_each_models_final_loss(tmp_path, monkeypatch, capsys):
    """`approxbp bdia train-toy` end to end on a tiny model (it used to fail formatting its summary)."""
    from approxbp.cli import main

    real = F.train_toy_gpt
    monkeypatch.setattr(F, "train_toy_gpt", lambda **kw: real(**{**kw, "blocks": 2, "d": 32, "batch": 2,
                                                                  "context": 16, "check_every": 1}))
    assert main(["bdia", "train-toy", "--steps", "2", "--out", str(tmp_path), "--no-progress"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split()[0] for ln in lines[:2]] == ["standard", "bdia"] and "final validation loss" in lines[0]
    assert (tmp_path / "bdia_toy_gpt.json").is_file() and (tmp_path / "bdia_toy_gpt.png").is_file()
