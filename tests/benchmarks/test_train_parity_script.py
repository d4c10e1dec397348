"""benchmarks/train_parity.py runs end to end on a few steps: every variant, JSON and figure."""

import json
import runpy

from _helpers import ROOT


def test_train_parity_script_runs_every_variant(tmp_path):
    main = runpy.run_path(str(ROOT / "benchmarks" / "train_parity.py"))["main"]
    out, fig = tmp_path / "r.json", tmp_path / "f.png"
    result = main(["--steps", "6", "--eval-every", "3", "--val-batches", "1", "--d", "32", "--layers", "1",
                   "--context", "16", "--batch", "4", "--out", str(out), "--figure", str(fig)])
    saved = json.loads(out.read_text())
    assert saved["final_val_loss"] == result["final_val_loss"] and len(saved["runs"]) == 5
    assert fig.stat().st_size > 10_000
    for run in saved["runs"].values():
        assert run["val_step"] == [3, 6] and len(run["train_loss"]) == 6
    losses = saved["final_val_loss"]
    # the same initial weights and batches: at 6 steps the variants differ only by the backward pass, a little
    assert max(losses.values()) - min(losses.values()) < 0.1 * losses["exact GELU"]
    assert saved["vocab"] > 60 and saved["corpus_chars"] > 100_000
