"""kernels/rewrite/plan_file.py: a plan written by `approxbp plan --out` read field by field, and matched to a model's
activation modules (as they are, or under a wrapper's prefix), refused whole when it was made for another model."""

import json

import pytest
from approxbp.approximations import tables as T
from approxbp.kernels.rewrite.plan_file import plan_config, read_plan
from torch import nn


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class _Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_MLP(), _MLP()])


def _plan(layers: dict, ms: bool = True) -> dict:
    return {"layers": layers, "ms_norm": {"chosen": ms, "saving": None}}


def test_a_plan_file_is_read_and_its_fields_checked(tmp_path):
    good = tmp_path / "plan.json"
    good.write_text(json.dumps(_plan({"blocks.0.act": {"table": None}})))
    assert read_plan(good)["ms_norm"]["chosen"] is True
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad.json: not a readable plan JSON file"):
        read_plan(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="'layers' must map module paths"):
        read_plan({"layers": {"blocks.0.act": {"table": 3}}, "ms_norm": {"chosen": True}})
    with pytest.raises(ValueError, match="'ms_norm' must be"):
        read_plan({"layers": {}, "ms_norm": {"chosen": "yes"}})


def test_layers_match_under_a_wrappers_prefix_and_name_their_tables():
    """peft wraps the planned model as base_model.model.…: a planned path matches as a suffix; a null table is the
    exact activation; MS-norms follow the plan."""
    wrapped = nn.Module()
    wrapped.base_model = nn.Module()
    wrapped.base_model.model = _Two()
    config = plan_config(_plan({"blocks.0.act": {"table": "relu_sum/gelu-k2-primitive"},
                                "blocks.1.act": {"table": None}}, ms=False), wrapped)
    assert config.tables == {"base_model.model.blocks.0.act": T.resolve("relu_sum/gelu-k2-primitive"),
                             "base_model.model.blocks.1.act": "exact"}
    assert config.norms is False and config.glu == set()


def test_a_glu_option_fuses_the_layers_parent():
    config = plan_config(_plan({"blocks.0.act": {"table": None, "option": "glu"},
                                "blocks.1.act": {"table": None}}), _Two())
    assert config.glu == {"blocks.0"}


@pytest.mark.parametrize("layers", [{"blocks.0.act": {"table": None}},  # blocks.1.act not in the plan
                                    {"blocks.0.act": {"table": None}, "blocks.1.act": {"table": None},
                                     "blocks.2.act": {"table": None}},  # a layer this model lacks
                                    {"act": {"table": None}}])  # a suffix matching two modules
def test_a_plan_made_for_another_model_is_refused(layers):
    with pytest.raises(ValueError, match="was made for another model"):
        plan_config(_plan(layers), _Two())
