"""One registry per layer for table families (issues 48 and 70): every dispatch on a table's family goes through
:func:`member`, so a family a layer does not know is refused by name, and a new family is its own files, found
through entry points (``tests/support/toy_family``), from fit to a planned and costed training step."""

from pathlib import Path

import pytest
from _helpers import python_path
from approxbp.approximations import tables as table_files
from approxbp.approximations.families import TABLE_FAMILIES, member
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
    t = table_files.read_json(table_files.resolve("invact/gelu-fast"))
    t["family"] = "free-levels"
    with pytest.raises(TableError, match="unknown family 'free-levels'"):
        table_files.from_json(t)


@pytest.fixture
def toy_family_installed(tmp_path, monkeypatch):
    """The toy family (``tests/support/toy_family``) installed as another package installs one: its entry points, one
    per registry, in a ``.dist-info`` folder on ``sys.path``; afterwards every layer forgets it."""
    import toy_family
    from approxbp.approximations.families import Registry

    dist = tmp_path / "site" / "toy_family-0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-family\nVersion: 0\n")
    (dist / "entry_points.txt").write_text("".join(f"[{group}]\ntoy-step = toy_family.{module}\n"
                                                   for group, module in toy_family.ENTRY_POINTS.items()))
    monkeypatch.syspath_prepend(str(dist.parent))
    yield dist.parent
    registries = _registries()
    assert all(isinstance(r, Registry) for r in registries)
    for registry in registries:
        registry.pop("toy-step", None)


def _registries():
    from approxbp.fitting.certify import CERTIFIERS
    from approxbp.kernels.codegen import RENDERERS
    from approxbp.kernels.ops.modules import FAMILIES

    from approxbp.commands.fit import FITS
    from approxbp.cost import LAUNCHES

    return [TABLE_FAMILIES, FAMILIES, RENDERERS, CERTIFIERS, LAUNCHES, FITS]


def test_a_toy_family_of_another_package_goes_from_fit_to_a_planned_costed_step(toy_family_installed, tmp_path,
                                                                               capsys):
    """Issue 70: a family is its own files, one per layer, found through entry points; nothing in approxbp names it.
    Fit (the CLI) → table → export → certify → drop-in (twin and Triton kernel) → patch_model → plan --use → cost."""
    import os
    import subprocess
    import sys

    import torch
    from approxbp.kernels import patch_model
    from torch.nn import functional as F

    from approxbp.cli import main

    root = Path(__file__).parents[2]
    for folder in ("approximations", "fitting", "kernels", "approxbp", "data"):
        for path in (root / folder).rglob("*.py"):
            text = path.read_text(encoding="utf-8").lower()
            assert "toy-step" not in text and "toy_step" not in text, path  # approxbp never names it
    tables = tmp_path / "tables"
    for act in ("gelu", "silu"):
        assert main(["fit", "toy-step", "--activation", act, "--out", str(tables / f"{act}-step.json")]) == 0
        assert main(["export", str(tables / f"{act}-step.json")]) == 0
    gelu_table = table_files.load(tables / "gelu-step.json")
    a, b = gelu_table.levels  # the mean slopes of GELU on [−4, 0] and [0, 4]
    assert type(gelu_table).__name__ == "ToyStepTable" and a == pytest.approx(3.167e-5, rel=1e-3) and b == 1 - a
    assert main(["certify", str(tables / "gelu-step.json")]) == 0  # its levels inside their Arb enclosures
    assert main(["tables", "--family", "toy-step", str(tables / "gelu-step.json")]) == 0

    from toy_family.op import ToyStepActivation, ToyStepSpec

    x = torch.linspace(-3, 3, 1001, dtype=torch.float32)
    for use_triton in (None, True):  # the PyTorch twin, then the generated kernel under TRITON_INTERPRET=1
        xi = x.clone().requires_grad_()
        y = ToyStepActivation(str(tables / "gelu-step.json"), use_triton=use_triton)(xi)
        y.backward(torch.ones_like(y))
        torch.testing.assert_close(y, F.gelu(x), rtol=0, atol=2e-6 if use_triton else 0)
        assert torch.equal(xi.grad, torch.where(x < 0, torch.tensor(a), torch.tensor(b)))

    ToyStepSpec.tables = tables  # where patch_model and the planner find the family's table of each activation
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    assert "swapped 1 activations" in str(patch_model(model, family="toy-step"))
    assert type(model[1]) is ToyStepActivation
    capsys.readouterr()
    assert main(["plan", "llama:hidden=64,layers=2,heads=4,intermediate=128,vocab=100", "--seq", "16", "--mode",
                 "lora", "--use", "toy-step", "--no-progress"]) == 0
    plan = capsys.readouterr().out
    assert "silu → toy-step (error 0.25): 2 layers" in plan, plan
    saved = [line.split()[-4:] for line in plan.splitlines() if line.strip().startswith("activation functions")]
    assert saved == [["8.00", "KiB", "4.00", "KiB"]], plan  # a bf16 x (2 bytes) → one flag byte per element

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # `cost` compiles for sm_90
    env["PYTHONPATH"] = python_path(toy_family_installed, Path(__file__).parents[1] / "support")
    r = subprocess.run([sys.executable, "-m", "approxbp", "cost", str(tables / "gelu-step.json"), "--dtype", "bf16"],
                       env=env, capture_output=True, text=True, timeout=300)  # a fresh process finds it too
    assert r.returncode == 0 and "toy gelu-step fwd" in r.stdout and "toy gelu-step bwd" in r.stdout, r.stderr


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
