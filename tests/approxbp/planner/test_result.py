"""approxbp/planner/result.py: a Plan written by `approxbp plan --out` loads back field for field, a file that is not
one is refused in one line, apply() patches a model as planned; a plan file
read field by field and matched to a model's activation modules (as they are, or under a wrapper's prefix), refused
whole when it was made for another model."""

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from approxbp.approximations import tables as table_files
from torch import nn

from approxbp.planner.plan_parts import Moves, MsNorm, PlannedLayer, StepSummary
from approxbp.planner.result import PLAN_SCHEMA, OptionCost, Plan, plan_config, read_plan


def _plan(**changes) -> Plan:
    step = dict(parameters=1, gradients=1, optimizer=2, activations=6, activations_by_kind={"activation": 6})
    base = dict(model="toy", mode="bf16", batch=2, seq=16, budget=None, before=StepSummary(**step, peak=10),
                after=StepSummary(**step, peak=8), layers={"act": PlannedLayer("gelu", "invact", "invact/gelu-fast",
                                                                                error=2e-7)},
                options={}, ms_norm=MsNorm(None, False))
    return Plan(**{**base, **changes})


def test_a_written_plan_loads_back_equal(tmp_path):
    options = {"gelu": {"exact": OptionCost(0, 0.0), "invact": OptionCost(4096, 2e-7)}}
    plan = _plan(moves=Moves({"blocks.0": "recompute"}, "NVIDIA H100", 8, 1e-3), use="invact", options=options)
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    assert json.loads(path.read_text())["options"]["gelu"]["invact"] == {"saving_per_layer": 4096, "error": 2e-7}
    loaded = Plan.load(path)
    assert loaded == plan and loaded.options["gelu"]["invact"].saving_per_layer == 4096
    path.write_text(json.dumps({**json.loads(path.read_text()), "options": {"gelu": {"exact": {"saving": 0}}}}))
    with pytest.raises(ValueError, match="'options' must map each activation"):
        Plan.load(path)


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


def _plan_json(layers: dict, ms: bool = True) -> dict:
    return {"layers": layers, "ms_norm": {"chosen": ms, "saving": None}}


def test_a_plan_file_is_read_and_its_fields_checked(tmp_path):
    good = tmp_path / "plan.json"
    good.write_text(json.dumps(_plan_json({"blocks.0.act": {"table": None}})))
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
    config = plan_config(_plan_json({"blocks.0.act": {"table": "relu_sum/gelu-k2-primitive"},
                                "blocks.1.act": {"table": None}}, ms=False), wrapped)
    assert config.tables == {"base_model.model.blocks.0.act": table_files.resolve("relu_sum/gelu-k2-primitive"),
                             "base_model.model.blocks.1.act": "exact"}
    assert config.norms is False and config.glu == set()


def test_a_glu_option_fuses_the_layers_parent():
    config = plan_config(_plan_json({"blocks.0.act": {"table": None, "option": "glu"},
                                "blocks.1.act": {"table": None}}), _Two())
    assert config.glu == {"blocks.0"}


@pytest.mark.parametrize("layers", [{"blocks.0.act": {"table": None}},  # blocks.1.act not in the plan
                                    {"blocks.0.act": {"table": None}, "blocks.1.act": {"table": None},
                                     "blocks.2.act": {"table": None}},  # a layer this model lacks
                                    {"act": {"table": None}}])  # a suffix matching two modules
def test_a_plan_made_for_another_model_is_refused(layers):
    with pytest.raises(ValueError, match="was made for another model"):
        plan_config(_plan_json(layers), _Two())


DATA = Path(__file__).parent / "data"


@pytest.mark.parametrize("name", ["plan-0.2.json", "plan-0.2-moves.json", "plan-1-chunked-loss.json"])
def test_a_plan_written_by_0_2_still_loads_and_a_newer_schema_is_refused_by_name(name, tmp_path):
    """0.2's plan files (written by `approxbp plan --out` before the JSON carried a version) and schema 1's load as
    schema 2; a plan of a later schema is refused, not misread; a plan written now carries its schema and reads back
    equal."""
    old = Plan.load(DATA / name)
    assert old.schema == PLAN_SCHEMA == 2 and old.layers and (old.moves is None) == (name == "plan-0.2.json")
    again = tmp_path / "again.json"
    again.write_text(old.to_json())
    assert json.loads(again.read_text())["schema"] == PLAN_SCHEMA and Plan.load(again) == old
    newer = {**json.loads(again.read_text()), "schema": PLAN_SCHEMA + 1}
    again.write_text(json.dumps(newer))
    with pytest.raises(ValueError, match=f"a plan of schema {PLAN_SCHEMA + 1}, written by a newer approxbp"):
        Plan.load(again)
    with pytest.raises(TypeError):
        Plan("model", "mode")  # built by keyword only


def test_a_schema_1_plans_loss_key_becomes_its_chunked_loss():
    """Schema 1 named the chunked loss "(loss)" among the blocks' moves (plan-1-chunked-loss.json: plan-0.2-moves.json
    with the moves a schema-1 plan of a recomputed block and the chunked loss has); read, the blocks' moves are
    module paths only and the loss is chunked; the file's dict is not changed by reading."""
    raw = json.loads((DATA / "plan-1-chunked-loss.json").read_text())
    plan = Plan.load(DATA / "plan-1-chunked-loss.json")
    assert plan.moves.moves == {"model.layers.0": "recompute"} and plan.chunked_loss
    assert asdict(plan.moves.chunked_loss) == {"chosen": True, **raw["moves"]["chunked_loss"]}
    assert read_plan(raw)["moves"]["moves"] == {"model.layers.0": "recompute"}
    assert "(loss)" in raw["moves"]["moves"]  # the caller's dict as it was
    assert not Plan.load(DATA / "plan-0.2-moves.json").chunked_loss  # a schema-1 plan without the key: not chunked
    assert plan.shard == 1 and read_plan({**raw, "mode": raw["mode"] + ", sharded over 4"})["shard"] == 4


@pytest.mark.parametrize("change, message", [
    ({"moves": {"moves": {}, "chunked_loss": {"chosen": "false"}}}, r"'moves.chunked_loss' must be null or"),
    ({"moves": ["blocks.0"]}, r"'moves' must be an object"),
    ({"moves": {"moves": {"blocks.0": 1}}}, r"'moves.moves' must be an object of block path"),
    ({"batch": -2}, r"'batch' must be an integer ≥ 1, got -2"),
    ({"batch": True}, r"'batch' must be an integer ≥ 1, got True"),
    ({"budget": -1}, r"'budget' must be bytes"),
    ({"seq": "sixteen"}, r"'seq' must be an integer ≥ 1 or null, got 'sixteen'"),
    ({"schema": "2"}, r"'schema' must be an integer ≥ 1 \(this approxbp writes 2\), got '2'"),
    ({"checkpoint": "false"}, r"'checkpoint' must be true or false"),
])
def test_plan_files_are_refused_field_by_field(tmp_path, change, message):
    """Each field a plan's reader uses is checked as tables are: "chosen": "false" was read as True, a list of moves
    failed inside result.py, a negative batch and seq "sixteen" were accepted, schema "2" was called newer."""
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({**json.loads(_plan().to_json()), **change}))
    with pytest.raises(ValueError, match=message):
        Plan.load(path)


def test_a_deep_or_huge_plan_file_is_refused_unread(tmp_path, monkeypatch):
    from approxbp.planner import result

    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)  # json.loads: RecursionError
    with pytest.raises(ValueError, match="deep.json: not a readable plan JSON file"):
        read_plan(deep)
    nested = tmp_path / "nested.json"
    nested.write_text(json.dumps({**_plan_json({}), "x": [[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]}))
    with pytest.raises(ValueError, match="nested more than 16 levels deep"):
        read_plan(nested)
    monkeypatch.setattr(result, "MAX_PLAN_BYTES", 100)
    big = tmp_path / "big.json"
    big.write_text(json.dumps({**_plan_json({}), "pad": "x" * 200}))
    with pytest.raises(ValueError, match=r"big.json: \d+ bytes; a plan file is at most 100 bytes"):
        read_plan(big)
