"""Every notebook runs top to bottom on a fresh install (a failing cell fails the suite) and shows its figures; the
two explorers take a user's activation in their parameters cell."""

import pytest
from _helpers import ROOT

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert NOTEBOOKS


#: Over ~5 s each on 2 cores, run by CI (APPROXBP_ALL_TESTS=1); the quick run executes the inverted-activation one
SLOW_NOTEBOOKS = ("bdia_reversibility", "error_atlas", "kernels_and_memory", "relu_sum_explorer")


def _run(path, tmp_path, activation: str | None = None):
    """The executed notebook; ``activation`` replaces 'gelu' in the cell tagged ``parameters``. (nbformat is imported
    here: its jsonschema import takes ~5 s, which every xdist worker would otherwise pay to collect these tests.)"""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    if activation is not None:
        cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
        assert "'gelu'" in cell.source
        cell.source = cell.source.replace("'gelu'", repr(activation), 1)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    errors = [f"{o.ename}: {o.evalue}" for o in outputs if o.output_type == "error"]
    assert not errors, errors
    return outputs


def _images(outputs) -> int:
    return sum("image/png" in o.get("data", {}) for o in outputs)


@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.slow) if p.stem in SLOW_NOTEBOOKS else p
                                  for p in NOTEBOOKS], ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes_and_shows_its_figures(path, tmp_path):
    assert _images(_run(path, tmp_path)) >= 1, "a figure was returned but not displayed (a cell ending in ';'?)"


@pytest.mark.slow  # fits made in the notebook: 30–70 s each on 2 cores
@pytest.mark.parametrize("name, activation", [("relu_sum_explorer", "x*erf(log(1+exp(x)))"),
                                              ("inverted_activation_explorer", "x*sigmoid(1.5*x)"),
                                              ("inverted_activation_explorer", "(x + sqrt(x**2 + 4))/2")])
def test_explorers_run_on_a_user_expression(name, activation, tmp_path):
    outputs = _run(ROOT / "notebooks" / f"{name}.ipynb", tmp_path, activation)
    assert _images(outputs) >= 2
    text = "".join(o.get("text", "") for o in outputs)
    assert "ours" in text or name == "inverted_activation_explorer"
    assert "sqrt" not in activation or "one branch; q(y) = y**2/(y**2 + 1)" in text


@pytest.mark.slow
def test_the_inverted_activation_explorer_draws_g_and_prints_a_refusal(tmp_path):
    """Smish is refused by InvAct (its tail rule errs by 1.6e-4): the explorer draws g, prints the refusal with its
    way forward, and does not raise (issue 47)."""
    outputs = _run(ROOT / "notebooks" / "inverted_activation_explorer.ipynb", tmp_path,
                   "x*tanh(log(1+1/(1+exp(-x))))")
    text = "".join(o.get("text", "") for o in outputs)
    assert "no InvAct table:" in text and "A way forward: approxbp fit relu-sum --levels free" in text
    assert _images(outputs) >= 2
