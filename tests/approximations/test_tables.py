"""Every committed table loads through the validating reader and its numbers re-measure."""

import copy
import json

import numpy as np
import pytest
from _helpers import table_json as _table
from approxbp.approximations import REGISTRY, ReLUSum, get_activation
from approxbp.approximations import table_schema as TS
from approxbp.approximations import tables as table_files
from approxbp.fitting import ReluSumObjective

RELU = table_files.table_paths("relu-sum")


def test_every_activation_bit_width_and_objective_is_committed():
    names = {p.stem for p in RELU}
    for a in REGISTRY:
        for k in range(1, 9):
            for o in ("primitive", "derivative"):
                assert f"{a}-k{k}-{o}" in names
    assert {"gelu-k2-primitive-paper", "silu-k2-primitive-paper", "gelu-k2-derivative-paper"} <= names


@pytest.mark.parametrize("path", RELU, ids=[p.stem for p in RELU])
def test_table_remeasures(path):
    t = table_files.load(path)
    rs = ReLUSum(t["weights"], t["knots"])
    obj = ReluSumObjective(get_activation(t["activation"]), t["bits"], t["objective"], t["interval"])
    assert obj.loss(rs) == pytest.approx(t["loss"], rel=1e-12)
    if t["source"] == "fit":
        assert rs.constraint_residual <= 1e-12
        paper = path.with_name(path.stem + "-paper.json")
        if paper.exists():
            assert t["loss"] <= table_files.load(paper)["loss"]


def test_loss_decreases_with_bits():
    for a in REGISTRY:
        for o in ("primitive", "derivative"):
            losses = [table_files.load(f"relu_sum/{a}-k{k}-{o}")["loss"] for k in range(1, 9)]
            assert all(np.diff(losses) < 0), (a, o, losses)


def _good():
    return json.loads(RELU[0].read_text())


@pytest.mark.parametrize("mutate,field", [
    (lambda t: t.pop("knots"), "knots"),
    (lambda t: t.update(schema="approxbp.table/9"), "schema"),
    (lambda t: t.update(levels=[0.0] * len(t["levels"])), "levels"),
    (lambda t: t.update(bits=12), "bits"),
    (lambda t: t["weights"].__setitem__(0, "x"), "weights"),
    (lambda t: t.update(constraint_residual=0.5), "constraint_residual"),
    (lambda t: t.update(family="spline"), "family"),
])
def test_reader_names_file_and_field(tmp_path, mutate, field):
    t = _good()
    mutate(t)
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(t))
    with pytest.raises(TS.TableError, match=f"bad.json: field '{field}'"):
        table_files.load(p)


@pytest.mark.parametrize("mutate, field, says", [
    (lambda t: t["levels"].__setitem__(1, 10**400), "levels",
     "element 1 is not a finite float (an integer of about 401"),
    (lambda t: t["knots"].__setitem__(0, "1e309"), "knots", "element 0 is not a finite float (str '1e309')"),
    (lambda t: t.update(loss=10**400), "loss", "not a finite float (an integer of about 401 digits"),
    (lambda t: t["interval"].__setitem__(1, float("inf")), "interval", "element 1 is not a finite float (float inf)"),
])
def test_hostile_numbers_are_refused_before_any_arithmetic(tmp_path, mutate, field, says):
    """An integer too large for a float ended `approxbp tables` with OverflowError; every numeric field is checked
    as a finite float first, in one line naming file and field."""
    t = _good()
    mutate(t)
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(t))
    with pytest.raises(TS.TableError, match=f"bad.json: field '{field}': ") as err:
        table_files.load(p)
    assert says in str(err.value)


def test_a_hostile_invact_coefficient_is_named(tmp_path):
    """A coefficient "1e309" (a string) was refused without naming file or field."""
    t = json.loads(table_files.resolve("invact/gelu-fast").read_text())
    name = next(iter(t["left"]["coefficients"]))
    for value, says in (("1e309", "str '1e309'"), (10**400, "an integer of about 401 digits")):
        t["left"]["coefficients"][name] = value
        p = tmp_path / "inv.json"
        p.write_text(json.dumps(t))
        with pytest.raises(TS.TableError, match=f"inv.json: field 'left.coefficients.{name}': not a finite float"):
            table_files.load(p)
        with pytest.raises(TS.TableError, match=says):
            table_files.load(p)


def test_unparsable_json_and_missing_file(tmp_path):
    p = tmp_path / "x.json"
    p.write_text("{")
    with pytest.raises(TS.TableError, match="not valid JSON"):
        table_files.load(p)
    with pytest.raises(FileNotFoundError):
        table_files.load(tmp_path / "missing.json")


def test_writer_is_canonical(tmp_path):
    t = _good()
    a, b = table_files.save(t, tmp_path / "a.json"), table_files.save(json.loads(json.dumps(t)), tmp_path / "b.json")
    assert a.read_bytes() == b.read_bytes()


@pytest.mark.parametrize("expression", ["sqrt(-1 - y*y)", "1e6", "b", "q_left_wrong*y"])
def test_combined_invact_form_is_validated_against_its_branches(expression):
    """The backward evaluates the combined q(y, b): it must equal the branch forms on their domains."""
    t = json.loads(table_files.resolve("gelu-fast", "invact").read_text())
    t["combined"]["expression"] = expression
    with pytest.raises(TS.TableError, match="combined"):
        table_files.validate(t, "t")


@pytest.mark.parametrize("name", ["None", "tl", "_tmp", "q_left", "b", "lambda"])
def test_form_names_the_generated_code_uses_are_refused(name):
    t = json.loads(table_files.resolve("silu-newton", "invact").read_text())
    t["left"]["assignments"] = [[name, "y"], *t["left"].get("assignments", [])]
    with pytest.raises(TS.TableError, match="must be a new identifier"):
        table_files.validate(t, "t")


# ---- moved from test_trust.py (untrusted input, atomic writes, numerics: no silent wrong answers) ----



def _mutate(name, fn):
    t = copy.deepcopy(_table(name))
    fn(t)
    return t


def _set(path, value):
    def fn(t):
        d = t
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = value
    return fn


BAD_TABLES = [
    ("relu_sum/gelu-k2-primitive-paper", _set(["weights"], [0.1, 1.0979632065417297, -0.048740595085551286]),
     "levels|constraint_residual"),
    ("relu_sum/gelu-k2-primitive", _set(["expression"], "x*sigmoid(x)"), "is not the activation 'gelu'"),
    ("relu_sum/gelu-k2-primitive", _set(["knots"], [-7.0, 0.0, 7.0]), "knots"),
    ("relu_sum/gelu-k2-primitive", _set(["knots"], [-3.0, -3.0, 3.0]), "strictly ascending"),
    ("invact/gelu-newton", lambda t: t["left"].__setitem__("domain", t["left"]["domain"][::-1]), "left.domain"),
    ("invact/gelu-newton", _set(["turning_point"], -0.70), "turning_point"),
    ("invact/gelu-newton", _set(["f_T"], -0.17), "f_T"),
    ("invact/gelu-newton", lambda t: t.pop("form"), "'form': missing"),
    ("invact/gelu-newton", _set(["form"], "x\nimport os"), "'form'"),
]


@pytest.mark.parametrize("name,fn,msg", BAD_TABLES)
def test_semantic_table_checks(name, fn, msg):
    t = _mutate(name, fn)
    with pytest.raises(TS.TableError, match=msg):
        table_files.validate(t, name)


def test_paper_table_with_weights_not_summing_to_one_is_refused():
    t = _table("relu_sum/gelu-k2-primitive-paper")
    t["weights"][1] += 0.01
    t["levels"] = [0.0, t["weights"][0], t["weights"][0] + t["weights"][1], sum(t["weights"])]
    w, c = t["weights"], t["knots"]
    t["constraint_residual"] = max(abs(sum(w) - 1), abs(sum(a * b for a, b in zip(w, c))))
    with pytest.raises(TS.TableError, match="Σw=1"):
        table_files.validate(t)


def test_refitting_an_unchanged_table_changes_no_bytes(tmp_path):
    p = tmp_path / "t.json"
    t = _table("relu_sum/gelu-k2-primitive")
    table_files.save(t, p)
    before, mtime = p.read_bytes(), p.stat().st_mtime_ns
    t2 = copy.deepcopy(t)
    t2["created"], t2["provenance"]["seconds"] = "2099-01-01", 123.0
    assert table_files.definition_sha256(t2) == table_files.definition_sha256(t)
    table_files.save(t2, p)
    assert p.read_bytes() == before and p.stat().st_mtime_ns == mtime
    t2["weights"] = t2["weights"]  # a real change is written
    t2["metrics"]["tail_mass"] = 0.0
    table_files.save(t2, p)
    assert p.read_bytes() != before


def test_an_old_free_level_study_file_is_refused_with_the_command_that_makes_a_table(tmp_path):
    path = tmp_path / "free.json"
    path.write_text('{"schema": "approxbp.free-levels/1", "activation": "gelu", "bits": 2}')
    with pytest.raises(TS.TableError, match="fit it again with `approxbp fit relu-sum --levels free"):
        table_files.load(path)


def test_a_free_level_table_keeps_levels_rule_free_and_eq_13_tables_are_unchanged():
    """ℓ₀ ≠ 0 and no Σw = 1 are allowed only with levels_rule free (and only for the derivative objective); an eq.
    13 table's JSON has no levels_rule field, so every packaged table's hash is what it was."""
    t = table_files.load("relu_sum/gelu-k2-derivative")
    assert t.levels_rule == "eq13" and "levels_rule" not in t.to_json()
    free = t | {"levels_rule": "free", "levels": [0.5 + v for v in t.levels]}
    assert table_files.from_json(free).name == "gelu-k2-derivative-free"
    with pytest.raises(TS.TableError, match="cumulative sums"):
        table_files.from_json(t | {"levels": [0.5 + v for v in t.levels]})  # eq. 13: ℓ₀ = 0
    with pytest.raises(TS.TableError, match="fits the derivative"):
        table_files.from_json(table_files.load("relu_sum/gelu-k2-primitive") | {"levels_rule": "free"})
    with pytest.raises(TS.TableError, match="levels_rule"):
        table_files.from_json(t | {"levels_rule": "fewbit"})
