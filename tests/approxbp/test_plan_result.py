"""approxbp/plan_result.py: a Plan written by `approxbp plan --out` loads back field for field, a file that is not
one is refused in one line, apply() patches a model as planned, and the report writes block ranges once."""

import json
from dataclasses import asdict

import pytest
import torch
from torch import nn

from approxbp.plan_result import Plan, _ranges


def _plan(**changes) -> Plan:
    base = dict(model="toy", mode="bf16", batch=2, seq=16, budget=None, before={"peak": 10}, after={"peak": 8},
                layers={"act": {"activation": "gelu", "option": "invact", "table": "invact/gelu-fast", "error": 2e-7}},
                options={}, ms_norm={"chosen": False, "saving": None})
    return Plan(**{**base, **changes})


def test_a_written_plan_loads_back_equal(tmp_path):
    plan = _plan(moves={"recompute": ["blocks.0"]}, use="invact")
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    assert asdict(Plan.load(path)) == asdict(plan)


def test_a_file_that_is_not_a_plan_is_refused_in_one_line(tmp_path):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"layers": {}, "ms_norm": {"chosen": False}}))
    with pytest.raises(ValueError, match=r"other.json: not a plan written by `approxbp plan --out` \(no model"):
        Plan.load(path)


def test_apply_patches_the_planned_layer_with_its_table():
    model = nn.Sequential(nn.Linear(4, 8))
    model.act = nn.GELU()
    report = _plan().apply(model)
    assert type(model.act).__name__ == "InvActivation" and "gelu-fast" in report.activations[0], report
    y = model.act(torch.linspace(-3, 3, 7, requires_grad=True))
    torch.testing.assert_close(y, nn.functional.gelu(torch.linspace(-3, 3, 7)), rtol=1e-6, atol=1e-6)


def test_block_ranges_are_written_once():
    """Runs of consecutive block indices written once; a top-level module (no dot) was printed as ".lm_head"."""
    paths = [f"model.layers.{i}" for i in (0, 1, 2, 5, 7, 8)] + ["lm_head"]
    assert _ranges(paths) == "model.layers.0–2, model.layers.5, model.layers.7–8, lm_head"
