"""benchmarks/trainer_budget.py: docs/training.md shows exactly the committed measurements, and every committed row
holds (within its budget on every step, or refused before the first)."""

import json
import runpy

import pytest
from _helpers import ROOT

pytest.importorskip("transformers")
SCRIPT = runpy.run_path(str(ROOT / "benchmarks" / "trainer_budget.py"))
RESULTS = json.loads((ROOT / "benchmarks" / "results" / "trainer_budget.json").read_text())


def test_the_docs_table_is_the_committed_measurements():
    start, end = SCRIPT["MARKERS"]
    table = (ROOT / "docs" / "training.md").read_text().split(start)[1].split(end)[0]
    assert table == SCRIPT["markdown"](RESULTS["rows"])


def test_every_committed_row_holds():
    rows = RESULTS["rows"]
    assert {r["name"] for r in rows} >= set(SCRIPT["ROWS"])
    for r in rows:
        if r.get("refused"):
            assert "fused LM head" in r["refused"] and max(r["stock"]) > r["planned"], r
        else:
            assert max(r["ours"]) <= r["budget"] < max(r["stock"]), r
            assert 0 <= max(r["ours"]) - r["planned"] <= 512, r  # the trainer's own scalars past the traced step
