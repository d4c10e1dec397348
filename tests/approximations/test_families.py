"""One registry per layer for table families (issue 48, item 2): every dispatch on a table's family goes through
:func:`member`, so a family a layer does not know is refused by name, and a new family's entries are what serve it."""

import pytest
from approxbp.approximations import tables as T
from approxbp.approximations.families import TABLE_FAMILIES, TableFamily, member, register
from approxbp.approximations.gradient_error import describe, gradient_error
from approxbp.approximations.table_schema import TableError


def test_an_unknown_family_is_refused_by_name_in_every_layer():
    from approxbp.fitting.certify import CERTIFIERS
    from approxbp.kernels.codegen import RENDERERS  # the build side: importing it registers the renderers

    from approxbp.cost import LAUNCHES

    for registry, what in ((TABLE_FAMILIES, "table class"), (RENDERERS, "Triton renderer"),
                           (CERTIFIERS, "certificate"), (LAUNCHES, "kernel launches")):
        assert {"relu-sum", "invact"} <= set(registry), what
        with pytest.raises(KeyError, match=f"no {what} for table family 'free-levels'; known: invact, relu-sum"):
            member(registry, "free-levels", what)
    t = T.read_json(T.resolve("invact/gelu-fast"))
    t["family"] = "free-levels"
    with pytest.raises(TableError, match="unknown family 'free-levels'"):
        T.from_json(t)


def test_a_toy_family_registered_in_each_layer_is_what_serves_its_tables():
    """A toy family reuses the InvAct table's shape under its own name: its record, not invact's, checks it, bounds
    its error, renders, certifies and costs it."""
    from approxbp.fitting.certify import CERTIFIERS, CertifyFamily, certifiable
    from approxbp.kernels.codegen import RENDERERS, render

    from approxbp.cost import LAUNCHES

    class ToyTable(T.InvActTable):
        family = "toy"

    calls = []
    entries = [(TABLE_FAMILIES, TableFamily("toy", ToyTable, lambda t, w: calls.append("validate"),
                                            lambda t, w: calls.append("certified"), lambda t: 0.125, "a toy bound")),
               (RENDERERS, lambda path, t: "# toy module"),
               (CERTIFIERS, CertifyFamily(lambda *a: ({}, [], True), lambda t: t.family == "toy")),
               (LAUNCHES, lambda table, dtype: [])]
    try:
        for registry, entry in entries:
            register(registry, "toy", entry)
        d = T.read_json(T.resolve("invact/gelu-fast"))
        d["family"] = "toy"
        t = T.from_json(d)
        assert type(t) is ToyTable and calls[0] == "validate" and "certified" in calls
        assert gradient_error(t) == 0.125 and describe("toy", 0.125) == "gradient error 0.12 (a toy bound)"
        assert render("toy.json", t) == "# toy module" and certifiable(t)
        assert LAUNCHES["toy"](None, None) == []
    finally:
        for registry, _ in entries:
            registry.pop("toy", None)
    assert "toy" not in TABLE_FAMILIES


def test_the_planner_options_are_the_families_own():
    """``approxbp plan``'s per-layer options come from each family's spec (``plan_options``), and an option's table
    is that family's ``packaged`` table: a toy family's option resolves through its own spec."""
    from approxbp.kernels.ops.modules import FAMILIES, Spec

    from approxbp.planner.plan_step import layer_options, option_table

    named = {n for spec in FAMILIES.values() for n in spec.plan_options}
    assert set(layer_options()) == named | {"exact", "glu"} and {"invact", "relu-sum-k2"} <= named
    assert option_table("silu", "relu-sum-k2") == "relu_sum/silu-k2-primitive"

    class ToySpec(Spec):
        family = "toy"
        plan_options = {"toy-k3": 3}

        @staticmethod
        def packaged(activation: str, bits: int) -> str:
            return f"toy/{activation}-{bits}"

    try:
        assert option_table("gelu", "toy-k3") == "toy/gelu-3"
        assert "toy-k3" in layer_options()  # registered after import, offered by --use and measured (it was frozen)
    finally:
        FAMILIES.pop("toy", None)
    assert "toy-k3" not in layer_options()
